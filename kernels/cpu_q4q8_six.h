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
 * bytes 0..63) from the 6 stored chunks at ``b``. The 16-bit shifts move bits across a
 * byte boundary only into bits that the masks clear. */
static inline __attribute__((always_inline)) QD_AVX2 void unpack6(const uint8_t* b,
                                                                  __m256i* u) {
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 32 * (4 + h)));
        const __m256i t[4] = {_mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 2), hb,
                              _mm256_srli_epi16(hb, 2)};
        for (int i = 0; i < 4; i++) {
            const __m256i nib = _mm256_loadu_si256((const __m256i*)(b + 32 * i));
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

#define QD_TILE6(NAME, TARGET, HALF)                                                       \
    static inline __attribute__((always_inline)) TARGET void NAME(                         \
            const int R, const uint8_t* codes, const int8_t* sc, const uint16_t* d,        \
            const int8_t* xq, const float* sx, const float* sumx, uint16_t* y, int cg,     \
            int n, int k) {                                                                \
        const int groups = k / 32;                                                         \
        __m256 acc[QD_MAX_ROWS];                                                           \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                          \
        const uint8_t* cb = codes + (size_t)cg * groups * QD_Q6_BLOCK;                     \
        const int8_t* scb = sc + (size_t)cg * groups * 16;                                 \
        const uint16_t* db = d + (size_t)cg * ((groups + 7) / 8) * 8;                      \
        __m256 dv = _mm256_setzero_ps();                                                   \
        for (int g = 0; g < groups; g++) {                                                 \
            __m256i u[8];                                                                  \
            prefetch_ahead(cb + (size_t)g * QD_Q6_BLOCK, QD_Q6_BLOCK, QD_AHEAD_8BIT);      \
            unpack6(cb + (size_t)g * QD_Q6_BLOCK, u);                                      \
            if (g % 8 == 0) /* a new super-block of 256 */                                 \
                dv = _mm256_cvtph_ps(                                                      \
                    _mm_loadu_si128((const __m128i*)(db + (size_t)(g / 8) * 8)));          \
            const __m128i sc16 = _mm_loadu_si128((const __m128i*)(scb + (size_t)g * 16));  \
            const __m256 s0 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16))); \
            const __m256 s1 = _mm256_mul_ps(                                               \
                dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8))));    \
            for (int r = 0; r < R; r++) {                                                  \
                const int8_t* xb = xq + (size_t)r * k + (size_t)g * 32;                    \
                const uint32_t halves = ((const uint32_t*)sumx)[(size_t)r * groups + g];   \
                const __m256i h0 = HALF(u, xb, -32 * (int16_t)(uint16_t)halves);           \
                const __m256i h1 = HALF(u + 4, xb + 16,                                    \
                                        -32 * (int16_t)(uint16_t)(halves >> 16));          \
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
                            const float* sumx, uint16_t* y, int lo, int hi, int n, int k) { \
        for (int cg = lo; cg < hi; cg++) {                                                 \
            QD_BY_ROWS(R, TILE, codes, sc, d, xq, sx, sumx, y, cg, n, k)                   \
        }                                                                                  \
    }
QD_COLUMNS6(columns6_avx2, QD_AVX2, tile6_avx2)
QD_COLUMNS6(columns6_vnni, QD_VNNI, tile6_vnni)
