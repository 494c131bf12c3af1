// The run report: one self-contained HTML file (inline SVG and CSS, no network, no external
// script) built from what a run leaves in its output directory:
//   log.jsonl       training records (loss, learning_rate, grad_norm, tokens_per_second) and
//                   evaluation records (eval_*)
//   memory.json     the plan per phase and category, planned vs measured peak, peak RSS
//   memory.jsonl    the memory timeline (bytes per category at each phase of each step)
//   run_args.json   the arguments of the run
//   eval_results.json  the metrics of `memtune eval --output_dir`
// Missing files leave their section out. The final metrics are grouped (training, evaluation,
// memory, speed) and shown in units for people (MiB/GiB with the exact byte count on hover,
// seconds, tokens/s). Every chart spans the page width, with value and step axes ticked at 1, 2 or
// 5 x 10^k; when the first logged losses dwarf the rest, a second loss panel starts after the
// first tenth of the steps. A small inline script measures the rendered page and writes the result
// into <pre id="render-check"> (used by the headless-browser test).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace memtune {

// The report's HTML for the run in `dir`. Throws an Error when dir holds none of the files.
std::string render_report(const std::filesystem::path& dir);

// Writes dir/report.html atomically and returns its path.
std::filesystem::path write_report(const std::filesystem::path& dir);

// The report's conventions, one function each.

// Axis ticks at a step of 1, 2 or 5 x 10^k: the smallest such step for which the multiples of
// the step from the one at or below lo to the one at or above hi are at most max_ticks values
// (with integer, a step of at least 1). An axis spans values.front()..values.back().
struct AxisTicks {
  double step = 1;
  std::vector<double> values;
};
AxisTicks nice_ticks(double lo, double hi, int max_ticks = 8, bool integer = false);

// A tick's label with no more digits than the step needs: "0.5", "1", "1.5"; "2e-5" for steps
// below 1e-4 or values of 1e7 and more.
std::string tick_label(double value, double step);

// Seconds for people: "52.3 ms", "26.4 s", "1 min 3 s", "2 h 5 min".
std::string format_seconds(double seconds);

// The final-metrics group of a key, checked in this order: "Memory" (*_bytes, *memory*),
// "Speed" (*runtime*, *_seconds, *per_second*, *_clock), "Evaluation" (eval_*, and every other
// result of `memtune eval` when from_eval_results), otherwise "Training".
std::string_view metric_group(std::string_view key, bool from_eval_results = false);

// A final metric's number as shown: *_bytes in B/KiB/MiB/GiB ("362.66 MiB"), seconds as
// format_seconds, *per_second as a rate ("5,213 tokens/s"), whole numbers with digit groups
// ("1,234,567"), others to 4 significant digits.
std::string metric_text(std::string_view key, double value);

}  // namespace memtune
