/* The 6-bit x 8-bit loop of cpu_q4q8.c for GGUF Q6_K matrices (Qwen2.5's LM head, and its
 * down and v matrices in half of its layers). Included by cpu_q4q8.c only (it uses its
 * helpers: load4, prefetch_ahead, store_rows, QD_BY_ROWS). */

/* ---- Q6_K weights (w = d * sc * q: q in -32..31, an int8 sc per 16, an fp16 d per 256) ----
 * Codes stored as u = q + 32 (0..63) in 6 bits, as the file does: 0.82 bytes a weight with the
 * scales (int8 codes: 1.07; Qwen2.5-1.5B's step 0.92x their time at 1 row, 0.97x at 2, 1.03x
 * at 8, where unpacking costs more than the bytes it saves; docs/kernels.md). Layout:
 * codes [n/8][k/32][6][8][4] uint8: block g of a column group is 6 chunks of 32 bytes, each
 * holding 4 bytes per column (32-bit lane i is column i):
 *   - chunks 0-3 (nibbles): chunk j's low nibbles are u's low 4 bits at k = 32g + 4j .. +3,
 *     its high nibbles those at k = 32g + 16 + 4j .. +3 (as the 4-bit layout);
 *   - chunks 4-5 (high bits): bits 2i, 2i + 1 of chunk 4 + h's bytes are u's top 2 bits at
 *     k = 32g + 16h + 4i .. +3 (i = 0..3).
 * sc [n/8][k/32][2][8] int8 (block g's two halves, 8 columns each), d [n/8][ceil(k/256)][8]
 * fp16. An AVX2 loop and, where the CPU has AVX512-VNNI, the same loop with vpdpbusd for its
 * integer sums (the same bits); per block s_h = d * sc_h (exact in fp32), then per row:
 *   acc = fma(float(isum0), s0 * sx, acc);   acc = fma(float(isum1), s1 * sx, acc)
 * with isum_h the exact integer sum of half h's 16 products q * xq, computed as
 * sum(u * xq) - 32 * sum(xq) (quantize_rows gives the halves' sums): u is unsigned, so
 * vpmaddubsw and vpdpbusd take it as it is (half6_avx2, half6_vnni). */
#define QD_Q6_BLOCK 192  /* bytes of codes per block of a column group */

/* Block codes u (8 chunks of [8 columns][4 bytes], k = 32g + 4j .. +3 in chunk j; as
 * bytes 0..63) from the 6 stored chunks at ``b``, ``chunk`` bytes apart. The shifts move bits
 * across a byte boundary only into bits that the masks clear. */
static inline __attribute__((always_inline)) QD_AVX2 void unpack6(const uint8_t* b, int chunk,
                                                                  __m256i* u) {
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + chunk * (4 + h)));
        const __m256i t[4] = {_mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 2), hb,
                              _mm256_srli_epi16(hb, 2)};
        for (int i = 0; i < 4; i++) {
            const __m256i nib = _mm256_loadu_si256((const __m256i*)(b + chunk * i));
            const __m256i lo4 = h ? _mm256_srli_epi16(nib, 4) : nib;
            u[4 * h + i] = _mm256_or_si256(_mm256_and_si256(lo4, low),
                                           _mm256_and_si256(t[i], top));
        }
    }
}

/* Half h's isum (its 16 products' exact sum, 8 columns) from codes u[4h .. 4h + 3] and the
 * block's x at xb: sum(u * xq) - 32 * sum(xq), starting from the latter. AVX2: vpmaddubsw
 * pairs, two pairs summed in 16 bits (|4 * 63 * 127| < 2^15), then vpmaddwd; VNNI: vpdpbusd,
 * 4 products at once into 32 bits. Exact integers both, so the same bits. */
static inline __attribute__((always_inline)) QD_AVX2 __m256i half6_avx2(const __m256i* u,
                                                                        const int8_t* xb,
                                                                        int32_t start) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p01 = _mm256_add_epi16(
        _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(load4(xb))),
        _mm256_maddubs_epi16(u[1], _mm256_set1_epi32(load4(xb + 4))));
    const __m256i p23 = _mm256_add_epi16(
        _mm256_maddubs_epi16(u[2], _mm256_set1_epi32(load4(xb + 8))),
        _mm256_maddubs_epi16(u[3], _mm256_set1_epi32(load4(xb + 12))));
    return _mm256_add_epi32(_mm256_set1_epi32(start), _mm256_add_epi32(
        _mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones)));
}

static inline __attribute__((always_inline)) QD_VNNI __m256i half6_vnni(const __m256i* u,
                                                                        const int8_t* xb,
                                                                        int32_t start) {
    __m256i a = _mm256_set1_epi32(start), b = _mm256_setzero_si256();
    a = _mm256_dpbusd_epi32(a, u[0], _mm256_set1_epi32(load4(xb)));
    b = _mm256_dpbusd_epi32(b, u[1], _mm256_set1_epi32(load4(xb + 4)));
    a = _mm256_dpbusd_epi32(a, u[2], _mm256_set1_epi32(load4(xb + 8)));
    b = _mm256_dpbusd_epi32(b, u[3], _mm256_set1_epi32(load4(xb + 12)));
    return _mm256_add_epi32(a, b);
}

/* -32 * sum(xq) of row r's block g, half h (quantize_rows's two int16s, low half first). */
static inline int32_t q6_start(const float* sumx, int r, int groups, int g, int h) {
    const uint32_t halves = ((const uint32_t*)sumx)[(size_t)r * groups + g];
    return -32 * (int16_t)(uint16_t)(halves >> (16 * h));
}

/* 8 columns (group cg), R rows; the weights paired or not (group_at). */
#define QD_TILE6(NAME, TARGET, HALF)                                                       \
    static inline __attribute__((always_inline)) TARGET void NAME(                         \
            const int R, const uint8_t* codes, const int8_t* sc, const uint16_t* d,        \
            const int8_t* xq, const float* sx, const float* sumx, uint16_t* y, int cg,     \
            int n, int k, int paired) {                                                    \
        const int groups = k / 32, supers = (groups + 7) / 8;                              \
        __m256 acc[QD_MAX_ROWS];                                                           \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                          \
        const GroupAt at = group_at(cg, n / 8, groups, paired, QD_Q6_BLOCK);               \
        const uint8_t* cb = codes + at.code0;                                              \
        const int8_t* scb = sc + at.first * groups * 16 + at.lane * 8; /* [g][2][8|16] */  \
        const uint16_t* db = d + at.first * supers * 8 + at.lane * 8;                      \
        __m256 dv = _mm256_setzero_ps();                                                   \
        for (int g = 0; g < groups; g++) {                                                 \
            __m256i u[8];                                                                  \
            prefetch_ahead(cb + (size_t)g * at.block, at.block, QD_AHEAD_6BIT);            \
            unpack6(cb + (size_t)g * at.block, at.chunk, u);                               \
            if (g % 8 == 0) /* a new super-block of 256 */                                 \
                dv = _mm256_cvtph_ps(_mm_loadu_si128(                                      \
                    (const __m128i*)(db + (size_t)(g / 8) * at.scales)));                  \
            const int8_t* sg = scb + (size_t)g * 2 * at.scales;                            \
            const __m256 s0 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(   \
                _mm_loadl_epi64((const __m128i*)sg))));                                    \
            const __m256 s1 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(   \
                _mm_loadl_epi64((const __m128i*)(sg + at.scales)))));                      \
            for (int r = 0; r < R; r++) {                                                  \
                const int8_t* xb = xq + (size_t)r * k + (size_t)g * 32;                    \
                const __m256i h0 = HALF(u, xb, q6_start(sumx, r, groups, g, 0));           \
                const __m256i h1 = HALF(u + 4, xb + 16, q6_start(sumx, r, groups, g, 1));  \
                const __m256 sxr = _mm256_set1_ps(sx[(size_t)r * groups + g]);             \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0), _mm256_mul_ps(s0, sxr), acc[r]); \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), _mm256_mul_ps(s1, sxr), acc[r]); \
            }                                                                              \
        }                                                                                  \
        store_rows(acc, R, y, cg, n);                                                      \
    }
QD_TILE6(tile6_avx2, QD_AVX2, half6_avx2)
QD_TILE6(tile6_vnni, QD_VNNI, half6_vnni)

#define QD_COLUMNS6(NAME, TARGET, TILE)                                                    \
    static TARGET void NAME(int R, const uint8_t* codes, const int8_t* sc,                 \
                            const uint16_t* d, const int8_t* xq, const float* sx,          \
                            const float* sumx, uint16_t* y, int lo, int hi, int n, int k,  \
                            int paired) {                                                  \
        for (int cg = lo; cg < hi; cg++) {                                                 \
            QD_BY_ROWS(R, TILE, codes, sc, d, xq, sx, sumx, y, cg, n, k, paired)           \
        }                                                                                  \
    }
QD_COLUMNS6(columns6_avx2, QD_AVX2, tile6_avx2)
QD_COLUMNS6(columns6_vnni, QD_VNNI, tile6_vnni)

/* ---- 16 columns a vector (AVX512-VNNI, paired weights: cpu_q4q8_wide.h's reasons) ---- */

/* unpack6 for a pair's 16 columns (64-byte chunks; 32-bit shifts, which AVX512F has, move
 * across bytes only what the masks clear, as the 16-bit ones do). */
static inline __attribute__((always_inline)) QD_VNNI void unpack6_16(const uint8_t* b,
                                                                     __m512i* u) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m512i hb = _mm512_loadu_si512((const void*)(b + 64 * (4 + h)));
        const __m512i t[4] = {_mm512_slli_epi32(hb, 4), _mm512_slli_epi32(hb, 2), hb,
                              _mm512_srli_epi32(hb, 2)};
        for (int i = 0; i < 4; i++) {
            const __m512i nib = _mm512_loadu_si512((const void*)(b + 64 * i));
            const __m512i lo4 = h ? _mm512_srli_epi32(nib, 4) : nib;
            u[4 * h + i] = _mm512_or_si512(_mm512_and_si512(lo4, low),
                                           _mm512_and_si512(t[i], top));
        }
    }
}

static inline __attribute__((always_inline)) QD_VNNI __m512i half6_16(const __m512i* u,
                                                                      const int8_t* xb,
                                                                      int32_t start) {
    __m512i a = _mm512_set1_epi32(start), b = _mm512_setzero_si512();
    a = _mm512_dpbusd_epi32(a, u[0], _mm512_set1_epi32(load4(xb)));
    b = _mm512_dpbusd_epi32(b, u[1], _mm512_set1_epi32(load4(xb + 4)));
    a = _mm512_dpbusd_epi32(a, u[2], _mm512_set1_epi32(load4(xb + 8)));
    b = _mm512_dpbusd_epi32(b, u[3], _mm512_set1_epi32(load4(xb + 12)));
    return _mm512_add_epi32(a, b);
}

/* Groups cg (even) and cg + 1, R rows: tile6's operations per column, in its order. */
static inline __attribute__((always_inline)) QD_VNNI void tile6_16(
        const int R, const uint8_t* codes, const int8_t* sc, const uint16_t* d,
        const int8_t* xq, const float* sx, const float* sumx, uint16_t* y, int cg, int n,
        int k) {
    const int groups = k / 32, supers = (groups + 7) / 8;
    __m512 acc[QD_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t* cb = codes + (size_t)cg * groups * QD_Q6_BLOCK;  /* [k/32][6][16][4] */
    const int8_t* scb = sc + (size_t)cg * groups * 16;              /* [k/32][2][16] */
    const uint16_t* db = d + (size_t)cg * supers * 8;               /* [supers][16] */
    __m512 dv = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i u[8];
        prefetch_ahead(cb + (size_t)g * 2 * QD_Q6_BLOCK, 2 * QD_Q6_BLOCK, 2 * QD_AHEAD_6BIT);
        unpack6_16(cb + (size_t)g * 2 * QD_Q6_BLOCK, u);
        if (g % 8 == 0) dv = scales16(db, g / 8);
        const int8_t* sg = scb + (size_t)g * 32;
        const __m512 s0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                _mm_loadu_si128((const __m128i*)sg))));
        const __m512 s1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                _mm_loadu_si128((const __m128i*)(sg + 16)))));
        for (int r = 0; r < R; r++) {
            const int8_t* xb = xq + (size_t)r * k + (size_t)g * 32;
            const __m512i h0 = half6_16(u, xb, q6_start(sumx, r, groups, g, 0));
            const __m512i h1 = half6_16(u + 4, xb + 16, q6_start(sumx, r, groups, g, 1));
            const __m512 sxr = _mm512_set1_ps(sx[(size_t)r * groups + g]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0), _mm512_mul_ps(s0, sxr), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1), _mm512_mul_ps(s1, sxr), acc[r]);
        }
    }
    store_rows16(acc, R, y, cg, n);
}

/* Column groups [lo, hi) (lo even) of paired 6-bit weights: pairs on tile6_16, an odd last
 * group on the 8-column tile. */
static QD_VNNI void wide6_vnni(int R, const uint8_t* codes, const int8_t* sc, const uint16_t* d,
                               const int8_t* xq, const float* sx, const float* sumx,
                               uint16_t* y, int lo, int hi, int n, int k) {
    int cg = lo;
    for (; cg + 1 < hi; cg += 2) {
        QD_BY_ROWS(R, tile6_16, codes, sc, d, xq, sx, sumx, y, cg, n, k)
    }
    if (cg < hi) columns6_vnni(R, codes, sc, d, xq, sx, sumx, y, cg, hi, n, k, 1);
}
