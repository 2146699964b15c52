// What the AMX kernels share: the tile configuration (eight tiles of 16 rows x 64 bytes)
// and the request to Linux for the tile state.
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(KERNELS_BF16_FAST)
#define KERNELS_AMX 1
#include <immintrin.h>

namespace kernels {

constexpr int TILE_ROWS = 16;  // every tile the kernels configure: 16 rows of 64 bytes

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

constexpr TileConfig eight_tiles() {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = TILE_ROWS;
    }
    return cfg;
}

// A constant, whole before any ldtilecfg reads it: a configuration built on the stack was
// once loaded before the compiler had zeroed its reserved bytes (a fault).
constexpr TileConfig TILES = eight_tiles();

// Linux hands out the tile registers' state only on request, once per process.
inline bool tiles_permitted() {
    static const bool permitted = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return permitted;
}

// Every thread that runs tile instructions configures them first and releases them after:
// the next user of the tiles (oneDNN) configures its own.
inline void configure_tiles() { _tile_loadconfig(&TILES); }

}  // namespace kernels
#endif
