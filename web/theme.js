// Applies the stored theme choice before the first paint (a classic script, not a module, so it
// runs before the body renders). No choice stored: the page follows prefers-color-scheme.
(function () {
  try {
    var theme = localStorage.getItem("quickdraft.theme");
    if (theme === "light" || theme === "dark") document.documentElement.dataset.theme = theme;
  } catch (e) { /* storage disabled: follow the system */ }
})();
