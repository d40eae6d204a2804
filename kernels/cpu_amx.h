/* What the C kernels' AMX loops share (cpu_q4q8_amx.h, cpu_attention_amx.h): the layout of a
 * tile configuration, Linux's permission for the tile state, and loading a configuration.
 * Included by those headers (kernels/cbuild.py expands it, once a source). */
#ifndef QD_CPU_AMX_H
#define QD_CPU_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* A tile configuration (ldtilecfg's 64 bytes; palette 1: up to 16 rows of 64 bytes). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes a row */
    uint8_t rows[16];
} QdTileConfig;

/* Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
 * 1 when granted (or already), 0 otherwise (an older kernel, a hypervisor hiding it). */
static int qd_amx_permitted(void) {
#if defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

/* Loads *c (its palette set to 1) as this thread's tile configuration. */
static __attribute__((target("amx-tile"))) void qd_tiles_load(QdTileConfig* c) {
    c->palette = 1;
    /* (gcc's ldtilecfg names only the first byte as its input: without this barrier the
     * stores to *c are dropped as dead) */
    __asm__ __volatile__("" : : "r"(c) : "memory");
    _tile_loadconfig(c);
}

#endif
