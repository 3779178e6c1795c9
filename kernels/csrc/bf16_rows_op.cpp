// The CPU kernel of the op `rollout_ssd::bf16_rows` (schema and Python fallback in bf16_rows.py), over
// the C kernel of bf16_rows.c, through torch's stable C ABI (torch/csrc/stable: header-only, so this
// file builds in seconds and does not depend on torch's C++ ABI).
//
// Why: compiled steps call the op once per linear, and a call that enters Python (the fallback: the
// dispatcher calls back into the interpreter, which calls the kernel through ctypes) costs more than
// the C++ call (bench/RESULTS.md, "The bf16 rows op's C++ kernel"). The checks are those of bf16_rows.linear; the sum is the same C code, so the
// result is bitwise the fallback's.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>

extern "C" {
#include "bf16_rows.c"
}

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

static Tensor bf16_rows_op(Tensor x, Tensor packed, std::optional<Tensor> bias, int64_t n) {
  STD_TORCH_CHECK(x.dim() == 2 && x.scalar_type() == ScalarType::BFloat16 && x.is_cpu(),
                  "rollout_ssd::bf16_rows: x must be a 2-D bf16 CPU tensor");
  const int64_t m = x.size(0), k = x.size(1);
  STD_TORCH_CHECK(n >= 0, "rollout_ssd::bf16_rows: n must be >= 0, got ", n);
  STD_TORCH_CHECK(k % 2 == 0 && packed.dim() == 4 && packed.scalar_type() == ScalarType::BFloat16 &&
                      packed.size(1) == k / 2 && packed.size(2) == TILE && packed.size(3) == 2 &&
                      packed.size(0) * TILE >= n,
                  "rollout_ssd::bf16_rows: x [", m, ", ", k, "] does not fit the packed weight with n=", n);
  STD_TORCH_CHECK(packed.is_cpu() && packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
                  "rollout_ssd::bf16_rows: packed must be a contiguous, 64-byte aligned CPU tensor as pack() makes it");
  std::optional<Tensor> b;
  if (bias.has_value()) {
    STD_TORCH_CHECK(bias->numel() == n, "rollout_ssd::bf16_rows: bias has ", bias->numel(), " elements, n=", n);
    b = torch::stable::contiguous(torch::stable::to(*bias, ScalarType::Float));
  }
  Tensor xc = torch::stable::contiguous(x);
  if (reinterpret_cast<uintptr_t>(xc.data_ptr()) % 4 != 0) {  // the kernel reads x in pairs of bf16
    xc = torch::stable::clone(xc);
  }
  Tensor out = torch::stable::new_empty(xc, {m, n});
  const int failed = ROWS_LINEAR(static_cast<const uint16_t *>(xc.data_ptr()), m, k, static_cast<const uint16_t *>(packed.data_ptr()),
                   n, b.has_value() ? static_cast<const float *>(b->data_ptr()) : nullptr,
                   static_cast<uint16_t *>(out.data_ptr()), static_cast<int>(torch::stable::get_num_threads()));
  STD_TORCH_CHECK(failed == 0, "rollout_ssd::bf16_rows: no memory for a float32 copy of x [", m, ", ", k, "]");
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(rollout_ssd, CPU, m) {
  m.impl("bf16_rows", TORCH_BOX(&bf16_rows_op));
}
