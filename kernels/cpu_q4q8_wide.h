/* The 4-bit AVX512-VNNI loop of cpu_q4q8.c, 16 output columns a vector: a pair of column
 * groups (2p, 2p + 1), stored chunk by chunk side by side (the layout in cpu_q4q8.c's
 * header), is one 64-byte load per chunk, and each row's 4 broadcast bytes of x feed 16
 * columns' vpdpbusd instead of 8. Per column the integers and the fp32 operations are those
 * of the 8-column tile (tile_vnni) in the same order, so the bits are the same as its and as
 * the AVX2 loop's; a last, odd group runs on the 8-column tile.
 *
 * Weights packed unpaired (kernels/cpu_q4q8.py does so where these loops do not run, i.e.
 * on AVX2-only CPUs, whose 8-column loop reads the paired layout 12-30 % slower, run on
 * the AVX512-BF16 EPYC) go
 * through the 8-column loops.
 *
 * Why: with 8 columns a vector the loop is bound by issuing instructions, not by the VNNI
 * units: one broadcast load, and per block one cvt, mul and two FMAs, for every 8 columns.
 * 16 columns halve those per column: 14-30 % faster a call at 2-16 rows with the weights in
 * cache on the AVX512-BF16 EPYC (Zen 4, which runs a 512-bit operation as two 256-bit
 * halves); SmolLM2's 120 layer matrices streamed from DRAM 3-17 % faster
 * (benchmarks/q4q8_loops.py). Reading the two groups as two streams 4.6 KB apart instead
 * was 1.3x slower from DRAM, hence the paired layout. The Q8_0 LM head gained nothing from
 * the same (1.07-1.21x the 8-column loop's time at 1-5 rows, 0.96x at 8-16): it stays on
 * 8 columns, unpaired.
 *
 * Included by cpu_q4q8.c only (it uses its helpers: load4, prefetch_ahead, store_rows). */

/* acc (16 columns: groups cg, cg + 1) of R rows, rounded to bf16, into y. */
static inline __attribute__((always_inline)) QD_VNNI void store_rows16(const __m512* acc,
                                                                       int R, uint16_t* y,
                                                                       int cg, int n) {
    __m256 lo[QD_MAX_ROWS], hi[QD_MAX_ROWS];
    for (int r = 0; r < R; r++) {
        lo[r] = _mm512_castps512_ps256(acc[r]);
        hi[r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
    }
    store_rows(lo, R, y, cg, n);
    store_rows(hi, R, y, cg + 1, n);
}

/* 16 fp16 scales of block g of a pair (group 2p's 8 then 2p + 1's) as fp32. */
static inline __attribute__((always_inline)) QD_VNNI __m512 scales16(const uint16_t* s,
                                                                     int g) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + (size_t)g * 16)));
}

/* 4-bit weights: groups cg (even) and cg + 1, R rows (tile_vnni's arithmetic). */
static inline __attribute__((always_inline)) QD_VNNI void tile16_vnni(
        const int R, const uint8_t* codes, const uint16_t* d, const uint16_t* mn,
        const int8_t* xq, const float* sx, const float* sumx, uint16_t* y, int cg, int n,
        int k) {
    const int groups = k / 32;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[QD_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t* cb = codes + (size_t)cg * groups * 128;  /* [k/32][4][16][4] */
    const uint16_t* db = d + (size_t)cg * groups * 8;       /* [k/32][16] */
    const uint16_t* mb = mn + (size_t)cg * groups * 8;
    for (int g = 0; g < groups; g++) {
        __m512i w[8];
        prefetch_ahead(cb + (size_t)g * 256, 256, QD_AHEAD_4BIT);
        for (int j = 0; j < 4; j++) {
            const __m512i b = _mm512_loadu_si512((const void*)(cb + (size_t)g * 256 + 64 * j));
            w[j] = _mm512_and_si512(b, low);
            /* (32-bit shifts: the mask drops what crosses into a byte from its neighbour) */
            w[4 + j] = _mm512_and_si512(_mm512_srli_epi32(b, 4), low);
        }
        const __m512 dv = scales16(db, g), mv = scales16(mb, g);
        for (int r = 0; r < R; r++) {
            const int8_t* xb = xq + (size_t)r * k + (size_t)g * 32;
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            for (int j = 0; j < 4; j += 2) {
                a = _mm512_dpbusd_epi32(a, w[j], _mm512_set1_epi32(load4(xb + 4 * j)));
                b = _mm512_dpbusd_epi32(b, w[j + 1], _mm512_set1_epi32(load4(xb + 4 * j + 4)));
                a = _mm512_dpbusd_epi32(a, w[4 + j], _mm512_set1_epi32(load4(xb + 16 + 4 * j)));
                b = _mm512_dpbusd_epi32(b, w[5 + j], _mm512_set1_epi32(load4(xb + 20 + 4 * j)));
            }
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[(size_t)r * groups + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sumx[(size_t)r * groups + g]), acc[r]);
        }
    }
    store_rows16(acc, R, y, cg, n);
}

/* Column groups [lo, hi) (lo even): pairs on the 16-column tile, an odd last group on the
 * 8-column one. */
static QD_VNNI void wide_vnni(int R, const uint8_t* codes, const uint16_t* d,
                              const uint16_t* mn, const int8_t* xq, const float* sx,
                              const float* sumx, uint16_t* y, int lo, int hi, int n, int k) {
    int cg = lo;
    for (; cg + 1 < hi; cg += 2) {
        QD_BY_ROWS(R, tile16_vnni, codes, d, mn, xq, sx, sumx, y, cg, n, k)
    }
    if (cg < hi) columns_vnni(R, codes, d, mn, xq, sx, sumx, y, cg, hi, n, k, 1);
}
