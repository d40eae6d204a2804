#!/usr/bin/env bash
# Re-vendor the browser libraries of the chat UI (docs/web.md). Needs npm and the npm registry;
# nothing here runs at serve time. Usage: bash web/vendor/update.sh [MARKED DOMPURIFY HLJS]
set -euo pipefail
MARKED=${1:-18.2.1}
DOMPURIFY=${2:-3.4.18}
HLJS=${3:-11.12.0}
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent "marked@$MARKED" "dompurify@$DOMPURIFY" "@highlightjs/cdn-assets@$HLJS" >/dev/null
for pkg in marked dompurify hljs; do mkdir "$pkg"; done
tar xzf "marked-$MARKED.tgz" -C marked
tar xzf "dompurify-$DOMPURIFY.tgz" -C dompurify
tar xzf "highlightjs-cdn-assets-$HLJS.tgz" -C hljs
# marked: the ES-module build (already minified); DOMPurify: its ES-module build (renamed .js so
# every static server sends a JavaScript MIME type); highlight.js: the official prebuilt browser
# bundle (ES module, minified, the "common" ~40 languages).
cp marked/package/lib/marked.esm.js "$here/marked.esm.js"
cp marked/package/LICENSE "$here/marked.LICENSE"
cp dompurify/package/dist/purify.es.mjs "$here/purify.es.js"
cp dompurify/package/LICENSE "$here/dompurify.LICENSE"
cp hljs/package/es/highlight.min.js "$here/highlight.min.js"
cp hljs/package/LICENSE "$here/highlight.js.LICENSE"
# the source maps are not vendored: drop their references (browsers would ask for them)
sed -i '/^\/\/# sourceMappingURL=/d' "$here/marked.esm.js" "$here/purify.es.js"
cat > "$here/VERSIONS" <<VERSIONS
marked $MARKED (npm: marked, lib/marked.esm.js)
dompurify $DOMPURIFY (npm: dompurify, dist/purify.es.mjs -> purify.es.js)
highlight.js $HLJS (npm: @highlightjs/cdn-assets, es/highlight.min.js)
VERSIONS
(cd "$here" && sha256sum marked.esm.js purify.es.js highlight.min.js >> VERSIONS)
echo "vendored into $here:"; cat "$here/VERSIONS"
