// corelm._core.testing: single kernels of any available table (tests compare every ISA with the scalar
// reference) and the AMX kernels and single tile instructions, on the emulation or the real tiles.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/amx/amx.h"
#include "kernels/kernels.h"
#include "kernels/ggml_formats.h"
#include "model/kv_cache.h"

namespace py = pybind11;

namespace corelm {

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Int8Array = py::array_t<int8_t, py::array::c_style | py::array::forcecast>;
using U8Array = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

const KernelTable& table(const std::string& isa) {
  const KernelTable* t = kernels_by_name(isa);
  if (!t) throw std::invalid_argument("kernel table '" + isa + "' is not available on this CPU");
  return *t;
}

// The real tiles only where they run; the emulation anywhere.
void need_native(bool emulated) {
  if (!emulated) amx::require_available();
}

}  // namespace

void register_testing_kernels(py::module_& m) {
  m.def("kernel_row_exact", [](const std::string& isa) {
    const KernelTable& t = table(isa);
    return std::string(t.row_exact ? t.row_exact->name : t.name);
  }, py::arg("isa"), "The table whose matmul gives each row of a few-row product the bits of a one-row product "
                     "(for checking speculative tokens): the table's row_exact, or itself.");
  m.def("kernel_matmul", [](const std::string& isa, FloatArray x, FloatArray w, const std::string& wtype, int64_t n0,
                            int64_t n1, const std::string& activations) {
    if (x.ndim() != 2 || w.ndim() != 2 || x.shape(1) != w.shape(1))
      throw std::invalid_argument("kernel_matmul needs x [M, K] and w [N, K]");
    const int64_t M = x.shape(0), N = w.shape(0), K = w.shape(1);
    if (n1 < 0) n1 = N;
    if (n0 < 0 || n0 > n1 || n1 > N) throw std::invalid_argument("bad column range");
    const KernelTable& kt = table(isa);
    PackedMatrix pw = kt.pack(w.data(), N, K, parse_weight_type(wtype), nullptr);
    py::array_t<float> y({M, N});
    std::fill(y.mutable_data(), y.mutable_data() + M * N, 0.f);
    const ActType act = parse_act_type(activations);
    const size_t qbytes = kt.quant_act_bytes(pw, M, act);
    if (act == ActType::I8 || !qbytes) {
      kt.matmul(x.data(), M, K, pw, y.mutable_data(), N, n0, n1);
    } else {
      auto qa = aligned_buffer(qbytes);
      kt.quantize_act(x.data(), M, K, pw, act, qa.get());
      kt.matmul_quant(qa.get(), M, act, pw, y.mutable_data(), N, n0, n1);
    }
    return y;
  }, py::arg("isa"), py::arg("x"), py::arg("w"), py::arg("wtype"), py::arg("n0") = 0, py::arg("n1") = -1,
     py::arg("activations") = "int8",
     "x W^T; with n0, n1 only columns [n0, n1) are computed (as one thread's share) and the rest stay 0. "
     "activations: how quantized weights take x (int8 through matmul, int16 through quantize_act/matmul_quant).");
  using RawArray = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;
  auto pack_raw = [](const KernelTable& kt, RawArray raw, const std::string& ggml_type, int64_t rows, int64_t cols) {
    WeightType t = quant::type_of_ggml(ggml_type);
    if (rows < 1 || cols < 1) throw std::invalid_argument("bad matrix shape");
    quant::check_raw(t, (size_t)raw.size(), rows, cols);
    return kt.pack_raw(t, raw.data(), rows, cols, nullptr);
  };
  m.def("kernel_matmul_raw", [pack_raw](const std::string& isa, FloatArray x, RawArray raw, const std::string& ggml_type,
                                        int64_t rows, int64_t cols, const std::string& activations, int64_t n0, int64_t n1) {
    if (x.ndim() != 2 || x.shape(1) != cols) throw std::invalid_argument("kernel_matmul_raw needs x [M, cols]");
    if (n1 < 0) n1 = rows;
    if (n0 < 0 || n0 > n1 || n1 > rows) throw std::invalid_argument("bad column range");
    const KernelTable& kt = table(isa);
    PackedMatrix pw = pack_raw(kt, raw, ggml_type, rows, cols);
    const int64_t M = x.shape(0);
    py::array_t<float> y({M, rows});
    std::fill(y.mutable_data(), y.mutable_data() + M * rows, 0.f);
    const ActType act = parse_act_type(activations);
    const size_t qbytes = kt.quant_act_bytes(pw, M, act);
    if (act == ActType::I8 || !qbytes) {
      kt.matmul(x.data(), M, cols, pw, y.mutable_data(), rows, n0, n1);
    } else {
      auto qa = aligned_buffer(qbytes);
      kt.quantize_act(x.data(), M, cols, pw, act, qa.get());
      kt.matmul_quant(qa.get(), M, act, pw, y.mutable_data(), rows, n0, n1);
    }
    return y;
  }, py::arg("isa"), py::arg("x"), py::arg("raw"), py::arg("ggml_type"), py::arg("rows"), py::arg("cols"),
     py::arg("activations") = "int8", py::arg("n0") = 0, py::arg("n1") = -1,
     "x W^T with W given as raw GGUF blocks [rows, row bytes], packed by the table; columns [n0, n1) only.");
  m.def("kernel_raw_to_f32", [pack_raw](const std::string& isa, RawArray raw, const std::string& ggml_type, int64_t rows,
                                        int64_t cols) {
    const KernelTable& kt = table(isa);
    PackedMatrix pw = pack_raw(kt, raw, ggml_type, rows, cols);
    py::array_t<float> y({rows, cols});
    for (int64_t r = 0; r < rows; r++) kt.row_to_f32(pw, r, y.mutable_data() + r * cols);
    return y;
  }, "Every row of raw GGUF blocks packed by a table, read back with row_to_f32.");
  m.def("kernel_packed_bytes", [](const std::string& isa, FloatArray w, const std::string& wtype) {
    if (w.ndim() != 2) throw std::invalid_argument("w must be 2-D");
    return table(isa).pack(w.data(), w.shape(0), w.shape(1), parse_weight_type(wtype), nullptr).bytes();
  });
  m.def("kernel_rmsnorm", [](const std::string& isa, FloatArray x, FloatArray w, float eps) {
    if (x.ndim() != 1 || w.ndim() != 1 || x.shape(0) != w.shape(0)) throw std::invalid_argument("shape mismatch");
    py::array_t<float> y(x.shape(0));
    table(isa).rmsnorm(y.mutable_data(), x.data(), w.data(), x.shape(0), eps);
    return y;
  });
  m.def("kernel_silu_mul", [](const std::string& isa, FloatArray g, FloatArray u) {
    if (g.ndim() != 1 || u.ndim() != 1 || g.shape(0) != u.shape(0)) throw std::invalid_argument("shape mismatch");
    py::array_t<float> y(g.shape(0));
    table(isa).silu_mul(y.mutable_data(), g.data(), u.data(), g.shape(0));
    return y;
  });
  m.def("kernel_gelu_tanh_mul", [](const std::string& isa, FloatArray g, FloatArray u) {
    if (g.ndim() != 1 || u.ndim() != 1 || g.shape(0) != u.shape(0)) throw std::invalid_argument("shape mismatch");
    py::array_t<float> y(g.shape(0));
    table(isa).gelu_tanh_mul(y.mutable_data(), g.data(), u.data(), g.shape(0));
    return y;
  });
  m.def("kernel_layernorm", [](const std::string& isa, FloatArray x, FloatArray w, FloatArray b, float eps) {
    if (x.ndim() != 1 || w.ndim() != 1 || b.ndim() != 1 || x.shape(0) != w.shape(0) || x.shape(0) != b.shape(0) ||
        x.shape(0) < 1)
      throw std::invalid_argument("shape mismatch");
    py::array_t<float> y(x.shape(0));
    table(isa).layernorm(y.mutable_data(), x.data(), w.data(), b.data(), x.shape(0), eps);
    return y;
  });
  m.def("kernel_gelu", [](const std::string& isa, FloatArray x) {
    if (x.ndim() != 1) throw std::invalid_argument("gelu needs a 1-D array");
    py::array_t<float> y(x.shape(0));
    std::copy(x.data(), x.data() + x.shape(0), y.mutable_data());
    table(isa).gelu(y.mutable_data(), x.shape(0));
    return y;
  });
  m.def("kernel_softmax", [](const std::string& isa, FloatArray x) {
    if (x.ndim() != 1 || x.shape(0) < 1) throw std::invalid_argument("softmax needs a non-empty 1-D array");
    py::array_t<float> y(x.shape(0));
    std::copy(x.data(), x.data() + x.shape(0), y.mutable_data());
    table(isa).softmax(y.mutable_data(), x.shape(0));
    return y;
  });
  // The attention kernels over one KV block; keys [hd][ldk] and values [n][hd] are given as arrays of
  // the cache's element type (float32, bf16 bits as uint16, int8).
  auto kv_array = [](const std::string& kv, py::array a, int64_t need) {
    const KVType t = parse_kv_type(kv);
    const bool ok = t == KVType::F32 ? py::isinstance<py::array_t<float>>(a)
                    : t == KVType::BF16 ? py::isinstance<py::array_t<uint16_t>>(a)
                                        : py::isinstance<py::array_t<int8_t>>(a);
    if (!ok || !(a.flags() & py::array::c_style)) throw std::invalid_argument("kv array: wrong dtype or not contiguous");
    if (a.size() < need) throw std::invalid_argument("kv array too small");
    return std::make_pair(t, a.data());
  };
  m.def("kernel_kv_scores", [kv_array](const std::string& isa, const std::string& kv, FloatArray q, py::array k,
                                       int64_t ldk, int64_t n) {
    if (q.ndim() != 2 || n < 1 || ldk < n) throw std::invalid_argument("kernel_kv_scores needs q [G, hd], 1 <= n <= ldk");
    const int64_t G = q.shape(0), hd = q.shape(1);
    auto [t, kp] = kv_array(kv, k, hd * ldk);
    py::array_t<float> s({G, n});
    table(isa).kv_scores(t, q.data(), G, hd, kp, ldk, n, s.mutable_data(), n);
    return s;
  });
  m.def("kernel_kv_accum", [kv_array](const std::string& isa, const std::string& kv, FloatArray p, py::array v,
                                      int64_t hd, FloatArray out) {
    if (p.ndim() != 2 || out.ndim() != 2 || out.shape(0) != p.shape(0) || out.shape(1) != hd || p.shape(1) < 1)
      throw std::invalid_argument("kernel_kv_accum needs p [G, n] and out [G, hd]");
    const int64_t G = p.shape(0), n = p.shape(1);
    auto [t, vp] = kv_array(kv, v, n * hd);
    py::array_t<float> y({G, hd});
    std::copy(out.data(), out.data() + G * hd, y.mutable_data());
    table(isa).kv_accum(t, p.data(), n, G, vp, n, hd, y.mutable_data());
    return y;
  });
  // The sparse attention kernels over n rows: masks [n][kv_mask_words(hd)] (uint32) and the kept
  // values [n][nk] (plus the kernels' slack, added here).
  auto sparse_vals = [kv_array](const std::string& kv, py::array val, int64_t n, int64_t nk) {
    auto [t, vp] = kv_array(kv, val, n * nk);
    const size_t bytes = (size_t)val.nbytes();
    auto copy = std::make_shared<std::vector<char>>(bytes + kKVSparseSlack, 0);
    std::memcpy(copy->data(), vp, bytes);
    return std::make_pair(t, copy);
  };
  auto sparse_masks = [](py::array_t<uint32_t, py::array::c_style | py::array::forcecast> mask, int64_t n, int64_t hd) {
    if (mask.ndim() != 2 || mask.shape(0) != n || mask.shape(1) != kv_mask_words(hd))
      throw std::invalid_argument("masks must be [n, kv_mask_words(hd)]");
    return mask;
  };
  m.def("kernel_kv_scores_sparse", [sparse_vals, sparse_masks](const std::string& isa, const std::string& kv,
                                                               FloatArray q, py::array mask, py::array val,
                                                               int64_t nk) {
    if (q.ndim() != 2) throw std::invalid_argument("q must be [G, hd]");
    const int64_t G = q.shape(0), hd = q.shape(1), n = mask.ndim() == 2 ? mask.shape(0) : 0;
    auto mk = sparse_masks(mask, n, hd);
    auto [t, vals] = sparse_vals(kv, val, n, nk);
    py::array_t<float> s({G, n});
    table(isa).kv_scores_sparse(t, q.data(), G, hd, mk.data(), vals->data(), nk, n, s.mutable_data(), n);
    return s;
  });
  m.def("kernel_kv_accum_sparse", [sparse_vals, sparse_masks](const std::string& isa, const std::string& kv,
                                                              FloatArray p, py::array mask, py::array val, int64_t nk,
                                                              FloatArray out) {
    if (p.ndim() != 2 || out.ndim() != 2 || out.shape(0) != p.shape(0))
      throw std::invalid_argument("kernel_kv_accum_sparse needs p [G, n] and out [G, hd]");
    const int64_t G = p.shape(0), n = p.shape(1), hd = out.shape(1);
    auto mk = sparse_masks(mask, n, hd);
    auto [t, vals] = sparse_vals(kv, val, n, nk);
    py::array_t<float> y({G, hd});
    std::copy(out.data(), out.data() + G * hd, y.mutable_data());
    table(isa).kv_accum_sparse(t, p.data(), n, G, mk.data(), vals->data(), nk, n, hd, y.mutable_data());
    return y;
  });
  // A KV cache of one layer, driven directly: store rows, read them back, attend.
  py::class_<KVCache>(m, "KVCache")
      .def(py::init([](int64_t n_kv_heads, int64_t head_dim, int64_t n_blocks, int64_t block_size,
                       const std::string& kv, double sparsity) {
             return new KVCache(1, n_kv_heads, head_dim, n_blocks, block_size, parse_kv_type(kv),
                                KVCache::kept(head_dim, sparsity));
           }),
           py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("n_blocks"), py::arg("block_size"), py::arg("kv"),
           py::arg("sparsity") = 0.0)
      .def_property_readonly("n_keep", &KVCache::n_keep)
      .def_property_readonly("bytes", &KVCache::bytes)
      .def("store", [](KVCache& c, int64_t block, int64_t slot, int64_t kv_head, bool value, FloatArray x) {
        c.store(0, block, slot, kv_head, value, x.data());
      })
      .def("load", [](const KVCache& c, int64_t block, int64_t slot, int64_t kv_head, bool value, int64_t hd) {
        py::array_t<float> x(hd);
        c.load(0, block, slot, kv_head, value, x.mutable_data());
        return x;
      })
      .def("attend", [](const KVCache& c, const std::string& isa, int64_t kv_head,
                        py::array_t<int32_t, py::array::c_style | py::array::forcecast> blocks, int64_t start,
                        int64_t end, FloatArray q, float scale, float softcap) {
        if (q.ndim() != 2 || start < 0 || end < start || (end / c.block_size()) >= blocks.size())
          throw std::invalid_argument("attend needs q [G, hd] and blocks covering [start, end]");
        const int64_t G = q.shape(0), hd = q.shape(1);
        std::vector<float> scores(G * (end - start + 1));
        py::array_t<float> out({G, hd});
        c.attend(table(isa), 0, kv_head, blocks.data(), start, end, q.data(), G, scale, softcap, scores.data(),
                 out.mutable_data());
        return out;
      });
  m.def("kernel_row_to_f32", [](const std::string& isa, FloatArray w, const std::string& wtype, int64_t row) {
    if (w.ndim() != 2 || row < 0 || row >= w.shape(0)) throw std::invalid_argument("bad matrix or row");
    PackedMatrix pw = table(isa).pack(w.data(), w.shape(0), w.shape(1), parse_weight_type(wtype), nullptr);
    py::array_t<float> y(w.shape(1));
    table(isa).row_to_f32(pw, row, y.mutable_data());
    return y;
  });

  m.def("kernel_amx_bf16_gemm", [](FloatArray x, FloatArray w, bool emulated, int64_t n0, int64_t n1) {
    if (x.ndim() != 2 || w.ndim() != 2 || x.shape(1) != w.shape(1) || w.shape(0) < 1 || w.shape(1) < 1)
      throw std::invalid_argument("kernel_amx_bf16_gemm needs x [M, K] and w [N, K]");
    need_native(emulated);
    const int64_t M = x.shape(0), N = w.shape(0), K = w.shape(1);
    if (n1 < 0) n1 = N;
    amx::AmxMatrix pw = amx::pack_bf16(w.data(), N, K);
    py::array_t<float> y({M, N});
    std::fill(y.mutable_data(), y.mutable_data() + M * N, 0.0f);  // columns outside [n0, n1) stay 0
    {
      py::gil_scoped_release release;
      if (emulated) amx::emulated::bf16_gemm(x.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#if defined(CORELM_HAVE_AMX_BUILD)
      else amx::native::bf16_gemm(x.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#endif
    }
    return y;
  }, py::arg("x"), py::arg("w"), py::arg("emulated"), py::arg("n0") = 0, py::arg("n1") = -1,
     "y = bf16(x) . bf16(w)^T with fp32 accumulation, on the AMX-BF16 kernel (emulated or real); only columns "
     "[n0, n1) are computed (n0 a multiple of 16), the rest are 0.");

  m.def("kernel_amx_int8_gemm", [](Int8Array xq, Int8Array wq, bool emulated, py::object xs_obj,
                                   py::object ws_obj, int64_t group, int64_t n0, int64_t n1) -> py::object {
    if (xq.ndim() != 2 || wq.ndim() != 2 || xq.shape(1) != wq.shape(1) || wq.shape(0) < 1 || wq.shape(1) < 1)
      throw std::invalid_argument("kernel_amx_int8_gemm needs xq [M, K] and wq [N, K] (int8)");
    need_native(emulated);
    const int64_t M = xq.shape(0), N = wq.shape(0), K = wq.shape(1);
    if (xs_obj.is_none() != ws_obj.is_none()) throw std::invalid_argument("give both scales or neither");
    if (n1 < 0) n1 = N;
    if (xs_obj.is_none()) {  // raw int32 sums
      std::vector<float> ones(N, 1.0f);
      amx::AmxMatrix pw = amx::pack_int8(wq.data(), ones.data(), N, K, 0);
      py::array_t<int32_t> y({M, N});
      std::fill(y.mutable_data(), y.mutable_data() + M * N, 0);
      py::gil_scoped_release release;
      if (emulated) amx::emulated::int8_gemm_i32(xq.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#if defined(CORELM_HAVE_AMX_BUILD)
      else amx::native::int8_gemm_i32(xq.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#endif
      return std::move(y);
    }
    FloatArray xs = xs_obj.cast<FloatArray>(), ws = ws_obj.cast<FloatArray>();
    const int64_t G = group == 0 ? 1 : K / group;
    if (xs.ndim() != 2 || ws.ndim() != 2 || xs.shape(0) != M || ws.shape(0) != N || xs.shape(1) != G ||
        ws.shape(1) != G)
      throw std::invalid_argument("scales must be xs [M, K/group] and ws [N, K/group]");
    amx::AmxMatrix pw = amx::pack_int8(wq.data(), ws.data(), N, K, group);
    py::array_t<float> y({M, N});
    std::fill(y.mutable_data(), y.mutable_data() + M * N, 0.0f);
    py::gil_scoped_release release;
    if (emulated) amx::emulated::int8_gemm(xq.data(), M, K, xs.data(), pw, y.mutable_data(), N, n0, n1);
#if defined(CORELM_HAVE_AMX_BUILD)
    else amx::native::int8_gemm(xq.data(), M, K, xs.data(), pw, y.mutable_data(), N, n0, n1);
#endif
    return std::move(y);
  }, py::arg("xq"), py::arg("wq"), py::arg("emulated"), py::arg("xs") = py::none(), py::arg("ws") = py::none(),
     py::arg("group") = 0, py::arg("n0") = 0, py::arg("n1") = -1,
     "int8 x int8 GEMM on the AMX-INT8 kernel: int32 sums, or fp32 sum_g xs[m,g]*ws[n,g]*sum_{k in g} when "
     "scales are given (group = K values per scale; 0 = one scale per row).");

  m.def("amx_quantize_rows", [](FloatArray x, int64_t group) {
    if (x.ndim() != 2 || x.shape(1) < 1) throw std::invalid_argument("amx_quantize_rows needs x [M, K]");
    const int64_t M = x.shape(0), K = x.shape(1);
    const int64_t G = group == 0 ? 1 : (group > 0 && K % group == 0 ? K / group : 0);
    if (G == 0) throw std::invalid_argument("the scale group must divide K");
    py::array_t<int8_t> q({M, K});
    py::array_t<float> s({M, G});
    amx::quantize_rows_s8(x.data(), M, K, K, group, q.mutable_data(), s.mutable_data());
    return py::make_tuple(q, s);
  }, py::arg("x"), py::arg("group") = 0,
     "The AMX-INT8 activation format: (q int8 [M, K], scales [M, K/group]), x ~ q * scale per row/group.");

  m.def("amx_tile_dp", [](const std::string& op, U8Array c, U8Array a, U8Array b, bool emulated) {
    if (op != "tdpbssd" && op != "tdpbf16ps") throw std::invalid_argument("op must be 'tdpbssd' or 'tdpbf16ps'");
    if (c.ndim() != 2 || a.ndim() != 2 || b.ndim() != 2) throw std::invalid_argument("tiles are 2-D byte arrays");
    const int rc = (int)c.shape(0), cbc = (int)c.shape(1), ra = (int)a.shape(0), cba = (int)a.shape(1);
    const int rb = (int)b.shape(0), cbb = (int)b.shape(1);
    if (!emulated) {  // the hardware raises SIGILL on these; the emulation reports them as errors
      need_native(false);
      bool ok = rc >= 1 && rc <= 16 && ra >= 1 && ra <= 16 && rb >= 1 && rb <= 16 && cbc >= 4 && cbc <= 64 &&
                cba >= 4 && cba <= 64 && cbb >= 4 && cbb <= 64 && ra == rc && cba == 4 * rb && cbb == cbc &&
                cbc % 4 == 0;
      if (!ok) throw std::invalid_argument("tile shapes the instruction would reject");
    }
    py::array_t<uint8_t> out({rc, cbc});
    std::memcpy(out.mutable_data(), c.data(), (size_t)rc * cbc);
    if (emulated) amx::emulated::single_dp(op == "tdpbssd", out.mutable_data(), rc, cbc, a.data(), ra, cba, b.data(), rb, cbb);
#if defined(CORELM_HAVE_AMX_BUILD)
    else amx::native::single_dp(op == "tdpbssd", out.mutable_data(), rc, cbc, a.data(), ra, cba, b.data(), rb, cbb);
#endif
    return out;
  }, py::arg("op"), py::arg("c"), py::arg("a"), py::arg("b"), py::arg("emulated") = true,
     "One TDPBSSD/TDPBF16PS on byte tiles C [rows, colsb], A, B; returns the new C bytes.");
}

}  // namespace corelm
