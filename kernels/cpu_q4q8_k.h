/* The 4-bit loop of cpu_q4q8.c for GGUF Q4_K matrices with the file's own scales: per block
 * of 32 a 6-bit scale sc and min mn (stored as bytes), per super-block of 256 an fp16 d and
 * dmin, w = (d * sc) * q - (dmin * mn) with q in 0..15. The 4-bit layout keeps one fp16 d and
 * m per block (0.625 bytes a weight, d * sc rounded to 11 bits); this one reads 0.578 and
 * forms d * sc and -dmin * mn per block, exact in fp32 (11 + 6 bits). On Qwen2.5-1.5B's Q4_K
 * matrices alone 0.94x the 4-bit layout's time at 1 row, 0.95x at 4 and 8; its whole step
 * 0.98x at 1 row, 1.02x at 2-3 (the per-block scale work), 0.96-0.98x at 4-8
 * (docs/kernels.md).
 *
 * Layout: codes as the 4-bit layout's, unpaired ([n/8][k/32][4][8][4]); sm [n/8][k/32][2][8]
 * uint8 (block g's 8 columns' sc, then their mn); dd [n/8][k/256][2][8] fp16 (super-block
 * s's 8 columns' d, then their -dmin). Per block dv = d * sc, mv = -dmin * mn (exact), then
 * per row the 4-bit tile's  acc = fma(float(isum), dv * sx, acc); acc = fma(mv, sumx, acc).
 * The AVX2 loop on every CPU kind (the same bits everywhere); kernels/cpu_q4q8.py packs these
 * only where the 4-bit weights are not paired (AVX2-only machines), keeping the 16-column
 * VNNI loop elsewhere. Included by cpu_q4q8.c only (it uses its helpers: unpack4, dot8_avx2,
 * prefetch_ahead, store_rows, QD_BY_ROWS). */

static inline __attribute__((always_inline)) QD_AVX2 void tilek_avx2(
        const int R, const uint8_t* codes, const uint8_t* sm, const uint16_t* dd,
        const int8_t* xq, const float* sx, const float* sumx, uint16_t* y, int cg, int n,
        int k) {
    const int groups = k / 32;
    __m256 acc[QD_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t* cb = codes + (size_t)cg * groups * 128;
    const uint8_t* smb = sm + (size_t)cg * groups * 16;
    const uint16_t* db = dd + (size_t)cg * (groups / 8) * 16;
    __m256 d8 = _mm256_setzero_ps(), m8 = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i w[8];
        prefetch_ahead(cb + (size_t)g * 128, 128, QD_AHEAD_4BIT);
        unpack4(cb + (size_t)g * 128, 32, w);
        if (g % 8 == 0) {  /* a new super-block of 256 */
            const uint16_t* s = db + (size_t)(g / 8) * 16;
            d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
            m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 8)));
        }
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(smb + (size_t)g * 16));
        const __m256 dv = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
        const __m256 mv = _mm256_mul_ps(
            m8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
        for (int r = 0; r < R; r++) {
            const __m256i isum = dot8_avx2(w, xq + (size_t)r * k + (size_t)g * 32);
            const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[(size_t)r * groups + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sumx[(size_t)r * groups + g]), acc[r]);
        }
    }
    store_rows(acc, R, y, cg, n);
}

static QD_AVX2 void columnsk_avx2(int R, const uint8_t* codes, const uint8_t* sm,
                                  const uint16_t* dd, const int8_t* xq, const float* sx,
                                  const float* sumx, uint16_t* y, int lo, int hi, int n,
                                  int k) {
    for (int cg = lo; cg < hi; cg++) {
        QD_BY_ROWS(R, tilek_avx2, codes, sm, dd, xq, sx, sumx, y, cg, n, k)
    }
}
