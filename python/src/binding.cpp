// memtune._memtune: memtune's command lines run in the Python process, with the Trainer's hooks.
// The package's Python code (python/memtune/) turns Trainer's API into a command line and a hooks
// object; this module runs the command outside the GIL and takes the GIL only to call back: a log
// record, a step's end, a checkpoint, and an evaluation's batches and row chunks for the
// predictions that compute_metrics receives. Arrays cross as numpy arrays: a logits chunk without a
// copy (valid only during the call, read-only), everything else small (a row's argmax and label
// log-prob, a batch's ids).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iostream>
#include <streambuf>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"

namespace py = pybind11;

namespace memtune {
namespace {

// Ctrl-C while the engine runs outside the GIL: Python's handler only sets a flag, seen here at
// the next call back (and, in training, by the run's own handler, which saves a checkpoint first).
void check_signals() {
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// std::cout during a command, handed to a Python callable a line at a time (sys.stdout.write, or a
// list's append when the caller captures the output).
class LineSink final : public std::streambuf {
 public:
  explicit LineSink(py::object write) : write_(std::move(write)) {}
  ~LineSink() override {
    try {
      emit();
    } catch (...) {  // a destructor does not throw; the line is lost
    }
  }

 protected:
  int overflow(int c) override {
    if (c == traits_type::eof()) return 0;
    line_.push_back(static_cast<char>(c));
    if (c == '\n') emit();
    return c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    line_.append(s, static_cast<size_t>(n));
    if (line_.find('\n') != std::string::npos) emit();
    return n;
  }
  int sync() override {
    emit();
    return 0;
  }

 private:
  void emit() {
    if (line_.empty()) return;
    const py::gil_scoped_acquire gil;
    write_(line_);
    line_.clear();
  }
  py::object write_;
  std::string line_;
};

// std::cout's buffer replaced while a command runs.
class RedirectStdout {
 public:
  explicit RedirectStdout(std::streambuf* to) : previous_(std::cout.rdbuf(to)) {}
  ~RedirectStdout() {
    std::cout.flush();
    std::cout.rdbuf(previous_);
  }

 private:
  std::streambuf* previous_;
};

template <typename T>
py::array_t<T> copy_array(const T* data, int64_t n) {
  py::array_t<T> out(n);
  std::copy_n(data, n, out.mutable_data());
  return out;
}

// The evaluation's batches and rows, handed to the sink (memtune/_predictions.py): start_batch
// with the batch's input ids, unshifted labels and sequence offsets; for each chunk either rows
// (positions in the batch, targets, argmax ids, label log-probs: 16 bytes a row from where the
// logits are) or logits (the [rows, V] chunk itself, for top-k, chosen token ids or the user's
// own reduction); then finish_batch.
class PythonPredictions final : public BatchObserver {
 public:
  PythonPredictions(py::object sink, bool logits) : sink_(std::move(sink)), logits_(logits) {}
  bool needs_logits() const override { return logits_; }

  void start_batch(const MicroBatch& b) override {
    const py::gil_scoped_acquire gil;
    check_signals();
    sink_.attr("start_batch")(copy_array(b.input_ids.data(), static_cast<int64_t>(b.input_ids.size())),
                              copy_array(b.labels.data(), static_cast<int64_t>(b.labels.size())),
                              copy_array(b.cu_seqlens.data(), static_cast<int64_t>(b.cu_seqlens.size())));
  }

  void observe_rows(const RowStatsChunk& c) override {
    if (logits_) return;
    const py::gil_scoped_acquire gil;
    py::array_t<int32_t> argmax(c.rows);
    py::array_t<float> logprob(c.rows);
    for (int64_t r = 0; r < c.rows; ++r) {
      argmax.mutable_at(r) = c.stats[r].argmax;
      logprob.mutable_at(r) = c.stats[r].target_logit - c.stats[r].logsumexp;
    }
    sink_.attr("rows")(copy_array(c.positions, c.rows), copy_array(c.targets, c.rows), argmax, logprob);
  }

  void observe(const LogitsChunk& c) override {
    const py::gil_scoped_acquire gil;
    check_signals();
    // The chunk itself, no copy: a read-only view whose memory the engine reuses after the call.
    const py::capsule no_owner(c.logits, [](void*) {});
    py::array_t<float> logits({c.rows, c.V}, {c.V * static_cast<int64_t>(sizeof(float)), int64_t{sizeof(float)}},
                              c.logits, no_owner);
    logits.attr("setflags")(py::arg("write") = false);
    sink_.attr("logits")(copy_array(c.positions, c.rows), copy_array(c.targets, c.rows), logits);
    if (logits.ref_count() != 1)
      throw Error(fmt::format(
          "preprocess_logits_for_metrics kept a reference to its [{}, {}] logits chunk, whose memory is reused "
          "after the call: return a reduction of it (argmax, gathered values) or a copy",
          c.rows, c.V));
  }

  void finish_batch() override {
    const py::gil_scoped_acquire gil;
    sink_.attr("finish_batch")();
  }

 private:
  py::object sink_;
  bool logits_;
};

// compute_metrics' dictionary as named numbers.
MetricValues metric_values(const py::handle& result) {
  MetricValues out;
  if (result.is_none()) return out;
  if (!py::isinstance<py::dict>(result))
    throw Error(fmt::format("compute_metrics returned {}: expected a dict of metric names to numbers",
                            py::str(py::type::of(result)).cast<std::string>()));
  for (const auto& [key, value] : result.cast<py::dict>()) {
    const std::string name = py::str(key).cast<std::string>();
    try {
      out.emplace_back(name, py::float_(py::reinterpret_borrow<py::object>(value)).cast<double>());
    } catch (const py::error_already_set&) {
      throw Error(fmt::format("compute_metrics returned {} for '{}': expected a number",
                              py::repr(value).cast<std::string>(), name));
    }
  }
  return out;
}

bool has(const py::object& o, const char* name) { return !o.is_none() && py::hasattr(o, name) && !o.attr(name).is_none(); }

// Runs one command line. `hooks` (None, or an object with any of on_log, on_step_end, on_save,
// should_stop, on_eval_result and predictions: the sink, with needs_logits and compute) reach the
// run; `output` receives std::cout a line at a time (None: std::cout as it is).
void run(const std::vector<std::string>& args, const py::object& hooks, const py::object& output) {
  TrainingHooks h;
  std::unique_ptr<PythonPredictions> predictions;
  // A Python callable called from the engine: the GIL held from the call to the result's release.
  auto call = [](py::object f) {
    return [f = std::move(f)](auto&&... a) {
      const py::gil_scoped_acquire gil;
      check_signals();
      f(a...);
    };
  };
  if (has(hooks, "on_log"))
    h.on_log = [f = call(hooks.attr("on_log"))](const nlohmann::json& record) { f(record.dump()); };
  if (has(hooks, "on_step_end"))
    h.on_step_end = [f = call(hooks.attr("on_step_end"))](int64_t step, int64_t max_steps) { f(step, max_steps); };
  if (has(hooks, "on_save"))
    h.on_save = [f = call(hooks.attr("on_save"))](const std::string& dir) { f(dir); };
  if (has(hooks, "should_stop"))
    h.should_stop = [f = py::object(hooks.attr("should_stop"))] {
      const py::gil_scoped_acquire gil;
      check_signals();
      return f().cast<bool>();
    };
  if (has(hooks, "on_eval_result"))
    h.eval.on_result = [f = call(hooks.attr("on_eval_result"))](const nlohmann::json& r) { f(r.dump()); };
  if (has(hooks, "predictions")) {
    const py::object sink = hooks.attr("predictions");
    predictions = std::make_unique<PythonPredictions>(sink, sink.attr("needs_logits").cast<bool>());
    h.eval.observer = predictions.get();
    h.eval.metrics = [f = py::object(sink.attr("compute"))] {
      const py::gil_scoped_acquire gil;
      check_signals();
      return metric_values(f());
    };
  }
  std::unique_ptr<LineSink> sink;
  if (!output.is_none()) sink = std::make_unique<LineSink>(output);
  cli::CommandLine line(h);
  {
    const py::gil_scoped_release released;
    const RedirectStdout redirect(sink ? sink.get() : std::cout.rdbuf());
    try {
      line.parse(args);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) {  // --help, --version
        line.app().exit(e);
        return;
      }
      throw Error(fmt::format("{} (memtune {})", e.what(), args.empty() ? std::string() : args[0]));
    }
    line.run();
  }
}

}  // namespace
}  // namespace memtune

PYBIND11_MODULE(_memtune, m) {
  m.doc() = "memtune's engine: command lines run in this process with the Trainer's hooks";
  static py::exception<memtune::Error> error(m, "MemtuneError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const memtune::Interrupted& e) {
      PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
    } catch (const memtune::Error& e) {
      py::set_error(error, e.what());
    }
  });
  m.def("run", &memtune::run, py::arg("args"), py::arg("hooks") = py::none(), py::arg("output") = py::none(),
        "Runs one memtune command line (without the program name) in this process.");
}
