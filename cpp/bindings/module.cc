// corelm._core: the C++ engine as a Python module. Model takes weights one by one (fp32 numpy
// arrays) and packs them; forward_batch() releases the GIL. Tests' and tools' entry points live in
// the submodule corelm._core.testing (bindings/testing_*.cc).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <thread>

#include "bindings/bindings.h"
#include "kernels/kernels.h"
#include "kernels/amx/amx.h"
#include "kernels/ggml_formats.h"
#include "kernels/quantize.h"
#include "model/model.h"
#include "runtime/collectives.h"

namespace py = pybind11;
using namespace corelm;

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

namespace {

std::vector<int64_t> shape_of(const FloatArray& a) {
  return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}

// ModelConfig as Python builds it (engine/model_builder.core_config): every field under its C++ name, the
// enums by their names (parsed once, when set: a bad name is a ValueError there), numa None for the default.
// Nothing else crosses into the core: no dict is parsed again.
void bind_model_config(py::module_& m) {
  py::class_<ModelConfig> c(m, "ModelConfig",
                            "A model's hyper-parameters, its family's features and the engine's options "
                            "(model/config.h); validated when a Model is built from it.");
  c.def(py::init<>()).def("copy", [](const ModelConfig& self) { return ModelConfig(self); });
#define CORELM_FIELD(name) c.def_readwrite(#name, &ModelConfig::name)
  CORELM_FIELD(vocab_size); CORELM_FIELD(lm_head_rows); CORELM_FIELD(dim); CORELM_FIELD(ffn_dim);
  CORELM_FIELD(n_layers); CORELM_FIELD(n_heads); CORELM_FIELD(n_kv_heads); CORELM_FIELD(head_dim);
  CORELM_FIELD(norm_eps); CORELM_FIELD(tie_embeddings); CORELM_FIELD(attention_bias); CORELM_FIELD(sliding_window);
  CORELM_FIELD(max_seq_len); CORELM_FIELD(rope_inv_freq); CORELM_FIELD(rope_dim); CORELM_FIELD(rope_attn_factor);
  CORELM_FIELD(rope_inv_freq_local); CORELM_FIELD(sliding_layers); CORELM_FIELD(qk_norm); CORELM_FIELD(qk_norm_whole);
  CORELM_FIELD(post_norms); CORELM_FIELD(embed_scale); CORELM_FIELD(attn_scale); CORELM_FIELD(attn_softcap);
  CORELM_FIELD(final_softcap); CORELM_FIELD(n_experts); CORELM_FIELD(n_experts_used); CORELM_FIELD(moe_norm_topk);
  CORELM_FIELD(causal); CORELM_FIELD(n_positions); CORELM_FIELD(n_token_types); CORELM_FIELD(layer_norm);
  CORELM_FIELD(norm_after_residual); CORELM_FIELD(gated_mlp); CORELM_FIELD(output_bias); CORELM_FIELD(n_threads);
  CORELM_FIELD(kv_sparsity); CORELM_FIELD(kv_block_size); CORELM_FIELD(kv_blocks); CORELM_FIELD(pin_threads);
#undef CORELM_FIELD
  c.def_property("activation", [](const ModelConfig& s) { return std::string(name_of(kActivationNames, s.activation)); },
                 [](ModelConfig& s, const std::string& v) { s.activation = parse_name(kActivationNames, v, "activation"); });
  c.def_property("weight_type", [](const ModelConfig& s) { return std::string(weight_type_name(s.weight_type)); },
                 [](ModelConfig& s, const std::string& v) { s.weight_type = parse_weight_type(v); });
  c.def_property("act_type", [](const ModelConfig& s) { return std::string(act_type_name(s.act_type)); },
                 [](ModelConfig& s, const std::string& v) { s.act_type = parse_act_type(v); });
  c.def_property("kv_type", [](const ModelConfig& s) { return std::string(kv_type_name(s.kv_type)); },
                 [](ModelConfig& s, const std::string& v) { s.kv_type = parse_kv_type(v); });
  c.def_property("schedule", [](const ModelConfig& s) { return std::string(schedule_name(s.schedule)); },
                 [](ModelConfig& s, const std::string& v) { s.schedule = parse_schedule(v); });
  c.def_property("numa",
                 [](const ModelConfig& s) -> std::optional<std::string> {
                   if (s.numa == NumaPolicy::Default) return std::nullopt;
                   return std::string(numa_policy_name(s.numa));
                 },
                 [](ModelConfig& s, std::optional<std::string> v) {
                   s.numa = v ? parse_numa_policy(*v) : NumaPolicy::Default;
                 });
}

// forward_batch's and hidden_batch's sequences, (n_tokens, pos, block_table, all_logits[, adapter]) each, as
// SeqSlices; the block tables stay alive in `tables`.
struct BatchSlices {
  std::vector<SeqSlice> slices;
  std::vector<py::array_t<int32_t, py::array::c_style | py::array::forcecast>> tables;
  BatchSlices(const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& tokens, py::list seqs) {
    if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be a 1-D array of token ids");
    int64_t total = 0;
    for (py::handle h : seqs) {
      py::tuple e = py::reinterpret_borrow<py::tuple>(h);
      if (e.size() != 4 && e.size() != 5)
        throw std::invalid_argument("each sequence is (n_tokens, pos, block_table, all_logits[, lora adapter id])");
      tables.push_back(e[2].cast<py::array_t<int32_t, py::array::c_style | py::array::forcecast>>());
      if (tables.back().ndim() != 1) throw std::invalid_argument("a block table must be 1-D");
      SeqSlice s;
      s.n_tokens = e[0].cast<int64_t>();
      s.pos = e[1].cast<int64_t>();
      s.blocks = tables.back().data();
      s.n_blocks = tables.back().shape(0);
      s.all_logits = e[3].cast<bool>();
      if (e.size() == 5) s.adapter = e[4].cast<int32_t>();
      if (s.n_tokens < 1) throw std::invalid_argument("every sequence in a batch needs at least one token");
      total += s.n_tokens;
      slices.push_back(s);
    }
    if (slices.empty()) throw std::invalid_argument("a batch needs at least one sequence");
    if (total != tokens.shape(0)) throw std::invalid_argument("the sequences' n_tokens must add up to len(tokens)");
  }
};

// One forward at a time per model: its scratch buffers and KV cache are shared state.
struct PyModel {
  explicit PyModel(const ModelConfig& c) : model(c) {}
  Model model;
  std::mutex mu;
};

// fn(address, n) as a hook the forward calls on n float32 at address: the forward runs without the GIL,
// so the call takes it back while fn runs. None: no hook.
std::function<void(float*, int64_t)> python_hook(py::object fn) {
  if (fn.is_none()) return {};
  auto held = std::make_shared<py::object>(std::move(fn));
  return [held](float* data, int64_t n) {
    py::gil_scoped_acquire gil;
    (*held)(reinterpret_cast<uintptr_t>(data), n);
  };
}

// Runs change(model) under the model's lock, without the GIL (a forward may hold the lock and wait on a
// hook that needs the GIL); change returns the hooks it replaced, which are let go of here with the GIL
// held, since they may hold the last reference to a Python callable.
template <class Change>
void replace_hooks(PyModel& self, Change change) {
  decltype(change(self.model)) old;
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(self.mu);
    old = change(self.model);
  }
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "corelm C++ core: kernels, thread pool and the Llama-family forward pass";

  m.def("cpu_info", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["brand"] = f.brand;
    d["features"] = f.names();
    d["kernel_tables"] = available_kernel_tables();
    const char* chosen = kernels().name;
    // the amx tables serve bf16 weights and leave the rest to the best other table
    const bool amx_table = std::string(chosen).rfind("amx", 0) == 0;
    py::dict k;
    for (const char* op : {"matmul_fp32", "matmul_bf16", "matmul_q8", "matmul_q4", "attention", "rmsnorm", "silu_mul"})
      k[op] = amx_table && std::string(op) != "matmul_bf16" ? amx::kernel_table_base() : chosen;
    d["kernels"] = k;
    d["bf16_native"] = f.os_avx512 && f.avx512_bf16;  // default dtype is bf16 where the CPU has AVX512_BF16
    d["amx"] = amx_info();
    return d;
  }, "CPU features, the kernel tables this CPU can run, and the one chosen for each operation.");
  bind_runtime(m);

  m.def("dequantize_gguf", [](const std::string& ggml_type, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> raw,
                              int64_t numel) {
    const WeightType t = quant::type_of_ggml(ggml_type);
    if (numel < 0) throw std::invalid_argument("numel must not be negative");
    quant::check_raw(t, (size_t)raw.size(), 1, numel);
    py::array_t<float> out(numel);
    {
      py::gil_scoped_release nogil;
      quant::dequantize_ggml(t, raw.data(), 1, numel, out.mutable_data());
    }
    return out;
  }, py::arg("ggml_type"), py::arg("raw"), py::arg("numel"),
     "numel weights of raw GGUF blocks of a type the kernels take (option_names()['raw_weight']) as float32, "
     "bit for bit as gguf.quants dequantizes them.");
  m.def("read_length_prefixed_strings", [](py::buffer buf, int64_t pos, int64_t n, int64_t max_len) {
    // GGUF's string arrays (a 150k vocabulary and its merges) without a Python loop per string: stops at
    // the first string that is truncated, too long or not UTF-8, and the caller's reader says why.
    const py::buffer_info b = buf.request();
    const auto* p = static_cast<const uint8_t*>(b.ptr);
    const int64_t size = b.size * b.itemsize;
    py::list out;
    int64_t j = 0;
    for (; j < n && pos >= 0 && size - pos >= 8; j++) {
      uint64_t len;
      std::memcpy(&len, p + pos, 8);
      if (len > (uint64_t)max_len || len > (uint64_t)(size - pos - 8)) break;
      PyObject* s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(p + pos + 8), (Py_ssize_t)len, "strict");
      if (!s) {
        PyErr_Clear();
        break;
      }
      out.append(py::reinterpret_steal<py::str>(s));
      pos += 8 + (int64_t)len;
    }
    return py::make_tuple(out, pos);
  }, py::arg("buf"), py::arg("pos"), py::arg("n"), py::arg("max_len"),
     "(strings, position after them): up to n little-endian u64-length-prefixed UTF-8 strings of buf from pos, "
     "stopping before the first that is truncated, longer than max_len or not UTF-8.");
  m.def("release_freed_heap", [] {
    py::gil_scoped_release nogil;
    release_freed_heap();
  }, "Hands the C heap's freed memory back to the OS (glibc's malloc_trim; a no-op elsewhere).");
  m.def("huge_pages_in_use", &huge_pages_in_use,
        "Whether large buffers (weights) still ask for 2 MiB pages: CORELM_HUGE_PAGES=auto (the default) until "
        "one takes longer than 1 ms to fault in (a VM whose fresh memory is slow), 1 always, 0 never.");
  m.def("count_nonfinite", [](py::array_t<uint8_t, py::array::c_style | py::array::forcecast> raw, int64_t block_bytes,
                              std::vector<int64_t> offsets, bool bf16) {
    if (block_bytes < 2) throw std::invalid_argument("block_bytes must be at least 2");
    for (int64_t o : offsets)
      if (o < 0 || o + 2 > block_bytes) throw std::invalid_argument("a 16-bit field must lie inside its block");
    const uint8_t* p = raw.data();
    const int64_t n = (int64_t)raw.size() / block_bytes;
    // NaN or Inf: the exponent all ones (fp16: bits 10..14, bf16: bits 7..14), read from the high byte
    const uint8_t hi_mask = bf16 ? 0x7F : 0x7C, lo_mask = bf16 ? 0x80 : 0x00;
    auto count = [&](int64_t b0, int64_t b1) {
      int64_t bad = 0;
      for (const uint8_t* q = p + b0 * block_bytes; b0 < b1; b0++, q += block_bytes)
        for (int64_t o : offsets) bad += (q[o + 1] & hi_mask) == hi_mask && (q[o] & lo_mask) == lo_mask;
      return bad;
    };
    // A model's tensors are read here first (their file pages mapped in): on a few threads when large
    const int threads = (int)std::clamp<int64_t>((int64_t)raw.size() >> 21, 1,
                                                 std::max(1u, std::min(4u, std::thread::hardware_concurrency())));
    std::vector<int64_t> bad(threads, 0);
    {
      py::gil_scoped_release nogil;
      std::vector<std::thread> helpers;
      for (int t = 1; t < threads; t++)
        helpers.emplace_back([&, t] { bad[t] = count(n * t / threads, n * (t + 1) / threads); });
      bad[0] = count(0, n / threads);
      for (std::thread& h : helpers) h.join();
    }
    return std::accumulate(bad.begin(), bad.end(), (int64_t)0);
  }, py::arg("raw"), py::arg("block_bytes"), py::arg("offsets"), py::arg("bf16") = false,
     "How many of the little-endian fp16 (or bf16) fields at `offsets` of each block_bytes-long block of raw are "
     "NaN or Inf.");
  m.def("option_names", [] {
    py::dict d;
    d["weight_type"] = names_of(kWeightTraits);
    d["kv_type"] = names_of(kKVTypeNames);
    d["activations"] = names_of(kActTypeNames);
    d["schedule"] = names_of(kScheduleNames);
    d["numa"] = names_of(kNumaPolicyNames);
    d["raw_weight"] = names_of(kWeightTraits, &WeightTraits::raw);
    d["activation"] = names_of(kActivationNames);
    return d;
  }, "The canonical name of every option the core takes by string (its C++ name tables), so the Python "
     "layer can check that its own names agree.");
  m.def("weight_formats", [] {
    py::list out;
    auto name_or_none = [](const char* s) { return s ? py::object(py::str(s)) : py::object(py::none()); };
    for (const WeightTraits& r : kWeightTraits) {
      py::dict d;
      d["name"] = r.name;
      d["raw"] = name_or_none(r.raw);
      d["ggml"] = name_or_none(r.ggml);
      d["ggml_id"] = r.ggml_id < 0 ? py::object(py::none()) : py::object(py::int_(r.ggml_id));
      d["block"] = r.block;
      d["block_bytes"] = r.block_bytes;
      d["float_rows"] = (r.kind & kFloatRows) != 0;
      d["quant"] = (r.kind & kQuantBlocks) != 0;
      d["ggml_block"] = (r.kind & kGgmlBlocks) != 0;
      d["sparse"] = (r.kind & kSparseRows) != 0;
      d["sparse_quant"] = (r.kind & kSparseQuant) != 0;
      d["grouped"] = (r.kind & kGrouped) != 0;
      d["dense"] = traits(r.dense).name;
      py::list f16;
      for (int at : {r.scale_at, r.min_at})
        if (at >= 0) f16.append(at);
      d["f16_fields"] = f16;
      out.append(d);
    }
    return out;
  }, "One dict per weight type, the core's traits rows (formats/traits.h): name, raw (Model.set_weight_raw's "
     "name or None), ggml and ggml_id (the GGUF type with these bytes or None), block (weights per block), "
     "block_bytes, the kind (float_rows, quant, ggml_block, sparse, sparse_quant; grouped), dense (the dense "
     "type a sparse one gives) and f16_fields (byte offsets of a block's fp16 scale and minimum).");

  bind_model_config(m);
  py::class_<PyModel>(m, "Model")
      .def(py::init([](const ModelConfig& cfg) { return new PyModel(cfg); }), py::arg("config"))
      .def("set_weight", [](PyModel& self, const std::string& name, FloatArray a) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lock(self.mu);
        self.model.set_weight(name, a.data(), shape_of(a));
      }, py::arg("name"), py::arg("array"))
      .def("set_weight_raw", [](PyModel& self, const std::string& name, const std::string& ggml_type,
                                py::array_t<uint8_t, py::array::c_style | py::array::forcecast> raw,
                                std::vector<int64_t> shape) {
        const WeightType t = quant::type_of_ggml(ggml_type);
        py::gil_scoped_release nogil;  // repacking: the tokenizer may be built meanwhile (LLMEngine)
        std::lock_guard<std::mutex> lock(self.mu);
        self.model.set_weight_raw(name, t, raw.data(), (size_t)raw.size(), shape);
      }, py::arg("name"), py::arg("ggml_type"), py::arg("raw"), py::arg("shape"),
         "Takes a matrix in a stored form (uint8; option_names()['raw_weight']): GGUF blocks (Q8_0/Q4_0/Q4_1 repacked, the others multiplied as stored, never dequantized), or bf16 rows (BF16; SBF16, stored sparse).")
      .def("finalize", [](PyModel& self) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lock(self.mu);
        self.model.finalize();
      })
      .def("set_allreduce_mpi", [](PyModel& self, uintptr_t iallreduce, uintptr_t iallgather, uintptr_t test, int comm,
                                   int float_type, int sum_op, int rank, int size,
                                   std::vector<std::pair<int, int>> local_peers, double stall_seconds) {
        MpichCalls calls;
        calls.iallreduce = reinterpret_cast<MpichCalls::Iallreduce>(iallreduce);
        calls.iallgather = reinterpret_cast<MpichCalls::Iallgather>(iallgather);
        calls.test = reinterpret_cast<MpichCalls::Test>(test);
        calls.comm = comm, calls.float_type = float_type, calls.sum_op = sum_op;
        auto reduce = std::make_shared<MpiAllreduce>(calls, rank, size, std::move(local_peers), stall_seconds);
        replace_hooks(self, [&](Model& m) {
          Model::Allreduce old = m.allreduce();
          m.set_allreduce([reduce](float* data, int64_t n) { (*reduce)(data, n); });
          return old;
        });
      }, py::arg("iallreduce"), py::arg("iallgather"), py::arg("test"), py::arg("comm"), py::arg("float_type"),
         py::arg("sum_op"), py::arg("rank"), py::arg("size"), py::arg("local_peers"), py::arg("stall_seconds"),
           "Tensor parallelism with the collectives called from C++ (no GIL): the addresses of MPI_Iallreduce, "
           "MPI_Iallgather and MPI_Test in the loaded MPI library and MPICH-ABI handles (runtime/collectives.h); "
           "local_peers: (rank, pid) of the ranks on this machine, whose death ends a wait with RankFailure.")
      .def("set_pipeline", [](PyModel& self, py::object receive, py::object send) {
        Model::Transfer in = python_hook(std::move(receive)), out = python_hook(std::move(send));
        replace_hooks(self, [&](Model& m) {
          auto old = m.pipeline();
          m.set_pipeline(std::move(in), std::move(out));
          return old;
        });
      }, py::arg("receive"), py::arg("send"),
           "Pipeline parallelism: receive(address, n) fills the n float32 hidden states at address from the stage "
           "before (instead of the embeddings), send(address, n) hands them to the stage after (and the forward "
           "computes no logits). None: this stage has none before / after.")
      .def("set_allreduce", [](PyModel& self, py::object fn) {
        Model::Allreduce f = python_hook(std::move(fn));
        replace_hooks(self, [&](Model& m) {
          Model::Allreduce old = m.allreduce();
          m.set_allreduce(std::move(f));
          return old;
        });
      }, py::arg("fn"),
           "Tensor parallelism: fn(address, n) sums the n float32 at address in place across the ranks (this "
           "model holds one rank's shard); called twice a layer during a forward. None: one process.")
      .def("park_threads", [](PyModel& self) { self.model.park_threads(); },
           "The worker threads sleep at once instead of spinning for the next forward: call it before "
           "another model (a speculative draft) runs on the same cores.")
      .def("forward_batch", [](PyModel& self, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens,
                               py::list seqs) {
        BatchSlices b(tokens, seqs);
        const int64_t rows = self.model.logit_rows(b.slices.data(), (int64_t)b.slices.size());
        py::array_t<float> logits({rows, self.model.config().logits_size()});
        const int32_t* tp = tokens.data();
        float* lp = logits.mutable_data();
        {
          py::gil_scoped_release release;
          std::lock_guard<std::mutex> lock(self.mu);
          self.model.forward_batch(tp, b.slices.data(), (int64_t)b.slices.size(), lp);
        }
        return logits;
      }, py::arg("tokens"), py::arg("seqs"),
         "Run several sequences at once: seqs is a list of (n_tokens, pos, block_table, all_logits[, adapter]), "
         "adapter a LoRA adapter's id (add_lora) or -1 for the base model.")
      .def("add_lora", [](PyModel& self, int32_t id, int64_t rank, float scale, py::dict targets) {
        std::vector<FloatArray> arrays;  // kept alive while the core packs them
        std::vector<LoraWeights> ws;
        for (auto item : targets) {
          py::tuple ab = py::reinterpret_borrow<py::tuple>(item.second);
          if (ab.size() != 2) throw std::invalid_argument("each LoRA target maps to (A, B)");
          arrays.push_back(ab[0].cast<FloatArray>());
          arrays.push_back(ab[1].cast<FloatArray>());
        }
        size_t i = 0;
        for (auto item : targets) {
          const FloatArray &a = arrays[i], &b = arrays[i + 1];
          ws.push_back(LoraWeights{item.first.cast<std::string>(), a.data(), shape_of(a), b.data(), shape_of(b)});
          i += 2;
        }
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lock(self.mu);
        self.model.add_lora(id, rank, scale, ws);
      }, py::arg("id"), py::arg("rank"), py::arg("scale"), py::arg("targets"),
         "Registers a LoRA adapter under id (>= 0): targets maps internal weight names (layers.<i>.wq, wk, wv, wo, "
         "w_gate, w_up, w_down) to (A [rank, in], B [out, rank]) float32; a sequence naming id gets "
         "y += scale * (x A^T) B^T after each of them.")
      .def("remove_lora", [](PyModel& self, int32_t id) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lock(self.mu);
        self.model.remove_lora(id);
      }, py::arg("id"))
      .def_property_readonly("lora_ids", [](PyModel& self) { return self.model.lora_ids(); })
      .def("hidden_batch", [](PyModel& self, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens,
                              py::list seqs) {
        BatchSlices b(tokens, seqs);
        py::array_t<float> hidden({(int64_t)tokens.shape(0), self.model.config().dim});
        const int32_t* tp = tokens.data();
        float* hp = hidden.mutable_data();
        {
          py::gil_scoped_release release;
          std::lock_guard<std::mutex> lock(self.mu);
          self.model.hidden_batch(tp, b.slices.data(), (int64_t)b.slices.size(), hp);
        }
        return hidden;
      }, py::arg("tokens"), py::arg("seqs"),
         "The same pass as forward_batch, giving every token's final hidden state [tokens, dim] (after the "
         "final norm) instead of logits: what embedding models pool. all_logits is ignored; an encoder's "
         "sequences must each be whole, from position 0.")
      .def_property_readonly("kv_block_size", [](PyModel& s) { return s.model.kv_cache().block_size(); })
      .def_property_readonly("kv_blocks", [](PyModel& s) { return s.model.kv_cache().n_blocks(); })
      .def_property_readonly("kv_bytes", [](PyModel& s) { return s.model.kv_cache().bytes(); })
      .def_property_readonly("kv_keep", [](PyModel& s) { return s.model.kv_cache().n_keep(); })
      .def_property_readonly("kv_type", [](PyModel& s) { return std::string(kv_type_name(s.model.kv_cache().type())); })
      .def_property_readonly("kv_block_bytes", [](PyModel& s) { return s.model.kv_cache().block_bytes(); })
      .def("kv_block_read", [](PyModel& s, int64_t block) {
             py::array_t<uint8_t> out((py::ssize_t)s.model.kv_cache().block_bytes());
             uint8_t* p = out.mutable_data();
             py::gil_scoped_release release;
             std::lock_guard<std::mutex> lock(s.mu);
             s.model.kv_cache().read_block(block, p);
             return out;
           }, py::arg("block"),
           "One KV block's bytes (all layers and kv heads: keys, values, int8 scales, sparse masks) as uint8 "
           "[kv_block_bytes], for kv_block_write into a cache of the same shape and type.")
      .def("kv_block_write", [](PyModel& s, int64_t block,
                                py::array_t<uint8_t, py::array::c_style | py::array::forcecast> data) {
             const size_t n = s.model.kv_cache().block_bytes();
             if (data.ndim() != 1 || (size_t)data.shape(0) != n)
               throw std::invalid_argument("kv_block_write needs a 1-D uint8 array of kv_block_bytes (" +
                                           std::to_string(n) + ") bytes");
             const uint8_t* p = data.data();
             py::gil_scoped_release release;
             std::lock_guard<std::mutex> lock(s.mu);
             s.model.kv_cache().write_block(block, p);
           }, py::arg("block"), py::arg("data"), "Overwrites one KV block with kv_block_read's bytes.")
      .def_property_readonly("weight_bytes", [](PyModel& s) { return s.model.weight_bytes(); })
      .def("last_routing", [](PyModel& s) {
             const std::vector<int32_t> r = s.model.last_routing();
             const ModelConfig& c = s.model.config();
             py::array_t<int32_t> out({c.n_layers, s.model.last_routing_tokens(), c.n_experts_used});
             std::copy(r.begin(), r.end(), out.mutable_data());
             return out;
           },
           "[n_layers, tokens, n_experts_used]: the experts the last forward picked for its tokens, each "
           "token's by falling router probability.")
      .def("record_input_squares", [](PyModel& s, bool on) {
             py::gil_scoped_release release;
             std::lock_guard<std::mutex> lock(s.mu);
             s.model.record_input_squares(on);
           }, py::arg("on"),
           "Calibration: while on, every forward adds each matrix's input column sums of squares over the rows it "
           "multiplied (input_squares). True starts afresh, False stops and keeps them.")
      .def("input_squares", [](PyModel& s) {
             std::map<std::string, Model::InputSquares> sq;
             {
               py::gil_scoped_release release;
               std::lock_guard<std::mutex> lock(s.mu);
               sq = s.model.input_squares();
             }
             py::dict out;
             for (const auto& [name, v] : sq) {
               py::array_t<double> sums((py::ssize_t)v.sums.size());
               std::copy(v.sums.begin(), v.sums.end(), sums.mutable_data());
               out[py::str(name)] = py::make_tuple(sums, v.rows);
             }
             return out;
           },
           "{internal weight name: (float64 [cols] sum of each input column's squares, rows)} recorded since "
           "record_input_squares(True): every matrix a forward multiplied (an expert's over the rows routed to it; "
           "wq/wk/wv and w_gate/w_up each under their own name, sharing one input).")
      .def_property_readonly("active_weight_bytes", [](PyModel& s) { return s.model.active_weight_bytes(); },
                             "What one decoded token reads: weight_bytes with only the used experts (of mean size).")
      .def_property_readonly("huge_page_promotion", [](PyModel& s) {
             const Model::HugePagePromotion p = s.model.huge_page_promotion();
             py::dict d;
             d["total_bytes"] = p.total, d["moved_bytes"] = p.done, d["running"] = p.running;
             return d;
           },
           "Where auto put the weights on 4 KiB pages (2 MiB ones came slowly), a thread of idle priority moves "
           "them onto 2 MiB pages: {total_bytes, moved_bytes, running} (total 0: nothing to move).")
      .def("weight_spans", [](PyModel& s) { return s.model.weight_spans(); },
           "[(name, address, bytes)] of the packed matrices in the order decode reads them.")
      .def_property_readonly("n_threads", [](PyModel& s) { return s.model.n_threads(); })
      .def_property_readonly("thread_cpus", [](PyModel& s) { return s.model.thread_cpus(); },
                             "The CPU each thread is pinned to (-1: not pinned); [0] is the calling thread.")
      .def_property("schedule", [](PyModel& s) { return std::string(schedule_name(s.model.pool().schedule())); },
                    [](PyModel& s, const std::string& name) {
                      const Schedule sched = parse_schedule(name);
                      py::gil_scoped_release release;
                      std::lock_guard<std::mutex> lock(s.mu);
                      s.model.set_schedule(sched);
                    }, "How kernels split work across threads: 'dynamic' or 'static' (settable between forwards).")
      .def_property_readonly("speed_shares", [](PyModel& s) { return s.model.pool().speed_shares(); },
                             "Each thread's smoothed speed as a share of the pool's (dynamic schedule).")
      .def_property_readonly("redone_chunks", [](PyModel& s) { return s.model.pool().redone_chunks(); },
                             "Chunks the calling thread redid because the thread holding them was descheduled.")
      .def("set_thread_nodes", [](PyModel& s, const std::vector<int>& nodes) {
             py::gil_scoped_release release;
             std::lock_guard<std::mutex> lock(s.mu);
             s.model.set_thread_nodes(nodes);
           }, py::arg("nodes"), "Which node's rows each thread works on first (fake nodes, for tests on one node).")
      .def("numa_info", [](PyModel& s, bool pages) { return numa_dict(s.model, pages); }, py::arg("pages") = false,
           "The NUMA policy, each thread's node, the buffers placed by node and (pages=True, a move_pages "
           "call per range) where their pages are now.")
      .def_property_readonly("max_seq_len", [](PyModel& s) { return s.model.config().max_seq_len; })
      .def_property_readonly("vocab_size", [](PyModel& s) { return s.model.config().vocab_size; })
      .def_property_readonly("kernel_table", [](PyModel& s) { return std::string(s.model.kernel_table().name); })
      .def_property_readonly("weight_type",
                             [](PyModel& s) { return std::string(weight_type_name(s.model.config().weight_type)); })
      .def_property("activations", [](PyModel& s) { return std::string(act_type_name(s.model.config().act_type)); },
                    [](PyModel& s, const std::string& a) {
                      const ActType act = parse_act_type(a);
                      py::gil_scoped_release release;
                      std::lock_guard<std::mutex> lock(s.mu);
                      s.model.set_act_type(act);
                    }, "How quantized matmuls take their input: int8 or int16 per block of 32 (settable between forwards).");

  py::register_exception<RankFailure>(m, "RankFailure", PyExc_RuntimeError);
  register_amx(m);
  m.def("kernel_tables", &available_kernel_tables, "The kernel tables this CPU can run, the default first.");

#ifdef CORELM_TESTING  // CMake's CORELM_TESTING option: tests' and tools' entry points, never in a default wheel
  py::module_ testing = m.def_submodule(
      "testing", "Entry points for tests and tools, not for the package: single kernels of any table, AMX tile "
      "instructions, benchmarks, and the runtime's placement functions.");
  register_testing_kernels(testing);
  register_testing_bench(testing);
  register_testing_runtime(testing);
  py::module_::import("sys").attr("modules")["corelm._core.testing"] = testing;  // `import corelm._core.testing`
#endif

  m.def("quantize_q4_1_search", [](FloatArray w, std::optional<FloatArray> importance) {
    if (w.ndim() != 2 || w.shape(1) % quant::kBlock != 0 || w.shape(0) < 1)
      throw std::invalid_argument("quantize_q4_1_search needs w [rows, cols] with cols a multiple of 32");
    const int64_t rows = w.shape(0), cols = w.shape(1);
    if (importance && (importance->ndim() != 1 || importance->shape(0) != cols))
      throw std::invalid_argument("importance must have one value per column of w");
    py::array_t<uint8_t> out({rows, cols / quant::kBlock * 20});
    const float* imp = importance ? importance->data() : nullptr;
    uint8_t* dst = out.mutable_data();
    {
      py::gil_scoped_release release;
      quant::quantize_q4_1_search(w.data(), imp, rows, cols, dst);
    }
    return out;
  }, py::arg("w"), py::arg("importance") = py::none(),
     "float32 [rows, cols] -> ggml Q4_1 blocks uint8 [rows, cols/32*20], each block's scale and minimum "
     "searched for the least squared error, weighted per column by `importance` when given.");

  m.def("quantize_ggml_search", [](FloatArray w, const std::string& type, std::optional<FloatArray> importance) {
    if (w.ndim() != 2 || w.shape(0) < 1) throw std::invalid_argument("quantize_ggml_search needs w [rows, cols]");
    const int64_t rows = w.shape(0), cols = w.shape(1);
    if (importance && (importance->ndim() != 1 || importance->shape(0) != cols))
      throw std::invalid_argument("importance must have one value per column of w");
    py::array_t<uint8_t> out({(size_t)rows, quant::ggml_search_row_bytes(type, cols)});
    const float* imp = importance ? importance->data() : nullptr;
    uint8_t* dst = out.mutable_data();
    {
      py::gil_scoped_release release;
      quant::quantize_ggml_search(type, w.data(), imp, rows, cols, dst);
    }
    return out;
  }, py::arg("w"), py::arg("type"), py::arg("importance") = py::none(),
     "float32 [rows, cols] -> GGUF blocks of type Q4_K, Q5_K, Q6_K (cols % 256 == 0), Q5_0 or Q5_1 (cols % 32 "
     "== 0), uint8 [rows, row bytes]: scales, minimums and codes searched for the least squared error, "
     "weighted per column by `importance` when given (cpp/kernels/quantize.h).");
}