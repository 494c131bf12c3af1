// The run report: one self-contained HTML file (inline SVG and CSS, no network, no external
// script) built from what a run leaves in its output directory:
//   log.jsonl       training records (loss, learning_rate, grad_norm, tokens_per_second) and
//                   evaluation records (eval_*)
//   memory.json     the plan per phase and category, planned vs measured peak, peak RSS
//   memory.jsonl    the memory timeline (bytes per category at each phase of each step)
//   run_args.json   the arguments of the run
//   eval_results.json  the metrics of `memtune eval --output_dir`
// Missing files leave their section out. A small inline script measures the rendered charts and
// writes the result into <pre id="render-check"> (used by the headless-browser test).
#pragma once

#include <filesystem>
#include <string>

namespace memtune {

// The report's HTML for the run in `dir`. Throws an Error when dir holds none of the files.
std::string render_report(const std::filesystem::path& dir);

// Writes dir/report.html atomically and returns its path.
std::filesystem::path write_report(const std::filesystem::path& dir);

}  // namespace memtune
