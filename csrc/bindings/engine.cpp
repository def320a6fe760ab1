// Bindings of the engine (csrc/engine): EngineCore runs a Plan (bindings/plan.cpp) over a mapped
// file; EngineState is one sequence. forward() releases the GIL for the whole step, so several
// Python threads may run forwards on one EngineCore at once, each with its own states.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include "cflow/engine.h"

namespace nb = nanobind;
using namespace cflow;
using namespace nb::literals;

namespace {

template <class T>
using Arr = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

// Keeps the Python object owning the mapped bytes alive as long as the engine.
struct PyEngine {
  nb::object owner;
  std::unique_ptr<Engine> eng;
};

// (keys' type, values' type) by name: "f32", "f16", "q8_0"
std::pair<std::string, std::string> kv_type_names(KvType k, KvType v) { return {kv_type_name(k), kv_type_name(v)}; }

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<State>(m, "EngineState", "One sequence: its tokens and KV cache")
      .def_prop_ro("pos", &State::pos, "tokens in the cache")
      .def_prop_ro("n_ctx", &State::n_ctx)
      .def_prop_ro("kv_types", [](const State& st) { return kv_type_names(st.key_type(), st.value_type()); },
                   "how the KV cache stores keys and values: ('f16', 'f16'), 'f32' or 'q8_0' each")
      .def_prop_ro("tokens", &State::tokens, "the token history (a copy)")
      .def("truncate", &State::truncate, "n"_a, "keep the first n tokens")
      .def("copy_prefix", &State::copy_prefix, "src"_a, "n"_a, "become the first n tokens of src and their KV cache")
      .def_prop_ro("kv_resident_bytes", &State::kv_resident_bytes, "bytes of the KV cache resident in memory");
  nb::class_<PyEngine>(m, "EngineCore", "Native plan executor (csrc/engine/executor.cpp)")
      .def(
          "__init__",
          [](PyEngine* self, nb::object owner, Arr<const uint8_t> buf, const Plan& plan, int n_ctx, int threads,
             bool fast, const std::string& schedule, bool all_experts, const std::string& experts,
             const std::string& path, uint64_t cache_bytes, int io_threads, bool predict, bool direct,
             const std::string& io, const std::string& key_type, const std::string& value_type) {
            if (buf.ndim() != 1) throw nb::value_error("weights must be a 1-D uint8 buffer");
            EngineOptions opt;
            if (schedule == "pipeline") opt.schedule = Schedule::Pipeline;
            else if (schedule != "sequential") throw nb::value_error("schedule must be 'sequential' or 'pipeline'");
            opt.all_experts = all_experts;
            if (experts == "sync") opt.experts = ExpertPolicy::Sync;
            else if (experts == "staged") opt.experts = ExpertPolicy::Staged;
            else if (experts != "mmap") throw nb::value_error("experts must be 'mmap', 'sync' or 'staged'");
            if (io_threads < 1 || io_threads > 256) throw nb::value_error("io_threads must be in 1..256");
            opt.tier.path = path;
            opt.tier.cache_bytes = cache_bytes;
            opt.tier.io_threads = io_threads;
            opt.tier.direct = direct;
            if (io == "uring") opt.tier.backend = IoBackend::Uring;
            else if (io != "pread") throw nb::value_error("io must be 'pread' or 'uring'");
            opt.predict = predict;
            auto kv_type = [](const std::string& name) -> std::optional<KvType> {
              if (name.empty()) return std::nullopt;
              for (KvType t : {KvType::F32, KvType::F16, KvType::Q8_0})
                if (name == kv_type_name(t)) return t;
              throw nb::value_error(("KV cache type must be 'f32', 'f16' or 'q8_0', got '" + name + "'").c_str());
            };
            opt.key_type = kv_type(key_type);
            opt.value_type = kv_type(value_type);
            nb::gil_scoped_release nogil;  // the tier allocates its buffers
            new (self) PyEngine{owner, std::make_unique<Engine>(buf.data(), buf.size(), plan, n_ctx, threads, fast, opt)};
          },
          "owner"_a, "buf"_a, "plan"_a, "n_ctx"_a, "threads"_a, "fast"_a, "schedule"_a = "sequential",
          "all_experts"_a = false, "experts"_a = "mmap", "path"_a = "", "cache_bytes"_a = 0, "io_threads"_a = 4,
          "predict"_a = true, "direct"_a = true, "io"_a = "pread", "key_type"_a = "", "value_type"_a = "")
      .def("new_state", [](PyEngine& e) { return e.eng->new_state(); })
      .def_prop_ro("threads", [](PyEngine& e) { return e.eng->threads(); })
      .def_prop_ro("kv_types", [](PyEngine& e) { return kv_type_names(e.eng->key_type(), e.eng->value_type()); },
                   "how the states' KV cache stores keys and values (State)")
      .def_prop_ro("vocab", [](PyEngine& e) { return e.eng->vocab(); })
      .def_prop_ro("prompt_rows_as_decode", [](PyEngine& e) { return e.eng->prompt_rows_as_decode(); },
                   "a prompt row computes bit for bit what a decode row computes")
      .def("profile", [](PyEngine& e) { return e.eng->profile(); })
      .def("byte_counts",
           [](PyEngine& e) {
             const ByteCounts c = e.eng->byte_counts();
             return nb::make_tuple(std::vector<uint64_t>(c.bytes, c.bytes + kNumStreams), c.steps, c.rows);
           },
           "(bytes per stream, steps, rows) since the engine was made")
      .def("tier_report",
           [](PyEngine& e) {
             const TierReport r = e.eng->tier_report();
             nb::dict d;
             d["hits"] = r.io.hits;
             d["misses"] = r.io.misses;
             d["hinted_reads"] = r.io.hinted_reads;
             d["hinted_used"] = r.io.hinted_used;
             d["reads"] = r.io.reads;
             d["bytes_read"] = r.io.bytes_read;
             d["read_s"] = r.io.read_s;
             d["busy_s"] = r.io.busy_s;
             d["wait_s"] = r.io.wait_s;
             d["slots"] = r.io.slots;
             d["direct"] = r.io.direct;
             d["io"] = r.io.backend == IoBackend::Uring ? "uring" : "pread";
             d["predicted"] = r.predicted;
             d["predicted_right"] = r.predicted_right;
             return d;
           },
           "the expert tier's counters since the engine was made (zeros without a tier)")
      .def_prop_ro("critical_path_bytes", [](PyEngine& e) { return e.eng->critical_path_bytes(); })
      .def_prop_ro("stream_bytes", [](PyEngine& e) { return e.eng->stream_bytes(); })
      .def_prop_ro("teams", [](PyEngine& e) { return e.eng->teams(); }, "per team: (lane bits, threads)")
      .def(
          "forward",
          [](PyEngine& e, std::vector<State*> states, std::vector<Arr<const int32_t>> tokens, bool all_logits,
             Arr<float> out) {
            if (states.size() != tokens.size()) throw nb::value_error("forward: one token array per state");
            std::vector<Seq> seqs(states.size());
            size_t rows = 0;
            for (size_t i = 0; i < seqs.size(); ++i) {
              if (!states[i]) throw nb::value_error("forward: a state is None");
              seqs[i] = {states[i], tokens[i].data(), (int)tokens[i].size()};
              rows += all_logits ? tokens[i].size() : 1;
            }
            if (out.size() < rows * (size_t)e.eng->vocab()) throw nb::value_error("forward: output array too small");
            nb::gil_scoped_release nogil;
            return e.eng->forward(seqs, all_logits, out.data());
          },
          "states"_a, "tokens"_a, "all_logits"_a, "out"_a, "fills out; returns whether every logit is finite");
}
