// pagedkv/reference/all.hpp: every CPU reference op (write_kv, decode, prefill, copy_blocks, swap_blocks) and the
// host dtype conversions, in namespace pagedkv::reference. Each op takes the same params struct as its CUDA
// launcher (pagedkv/kernel_params.hpp), validates first and returns `[[nodiscard]] Status`; all memory is host
// memory.
#pragma once

#include <pagedkv/reference/common.hpp>
#include <pagedkv/reference/copy_blocks.hpp>
#include <pagedkv/reference/decode.hpp>
#include <pagedkv/reference/dtype.hpp>
#include <pagedkv/reference/prefill.hpp>
#include <pagedkv/reference/swap_blocks.hpp>
#include <pagedkv/reference/write_kv.hpp>
