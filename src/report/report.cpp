#include "report/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_reader.h"
#include "core/jsonl.h"
#include "io/safetensors.h"
#include "memory/plan.h"

namespace memtune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// A run file's JSON, or nullopt when the run did not write it.
std::optional<json> read_json_file_if_present(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  return read_json_file(path);
}

// Every JSON line of a .jsonl file; lines that do not parse (a torn last line from a killed run)
// are skipped.
std::vector<json> read_json_lines(const fs::path& path) {
  std::vector<json> out;
  std::error_code ec;
  if (!fs::exists(path, ec)) return out;
  JsonlReader reader(path, BadLines::Skip);
  for (json record; reader.next(record);) out.push_back(std::move(record));
  return out;
}

std::string number(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{:.4g}", v);
}

std::string value_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) return number(v.get<double>());
  return v.dump();
}

constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y)
};

// Geometry shared by the charts: a plot area inside margins, linear scales.
struct Frame {
  static constexpr double W = 640, H = 260, left = 78, right = 16, top = 16, bottom = 36;
  double x0, x1, y0, y1;
  double sx(double x) const { return left + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - left - right); }
  double sy(double y) const { return H - bottom - (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5) * (H - top - bottom); }
  std::string axes(const std::string& xlabel, const std::function<std::string(double)>& yfmt) const {
    std::string s = fmt::format(
        R"(<line class="axis" x1="{0}" y1="{1}" x2="{2}" y2="{1}"/><line class="axis" x1="{0}" y1="{3}" x2="{0}" y2="{1}"/>)",
        left, H - bottom, W - right, top);
    for (int i = 0; i <= 4; ++i) {
      const double y = y0 + (y1 - y0) * i / 4.0;
      s += fmt::format(R"(<text class="tick" x="{}" y="{:.1f}" text-anchor="end">{}</text>)", left - 6, sy(y) + 4,
                       escape(yfmt(y)));
      s +=
          fmt::format(R"(<line class="grid" x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}"/>)", left, sy(y), W - right, sy(y));
    }
    s += fmt::format(R"(<text class="tick" x="{}" y="{}" text-anchor="start">{}</text>)", left, H - bottom + 16,
                     number(x0));
    s += fmt::format(R"(<text class="tick" x="{}" y="{}" text-anchor="end">{}</text>)", W - right, H - bottom + 16,
                     number(x1));
    s += fmt::format(R"(<text class="label" x="{}" y="{}" text-anchor="middle">{}</text>)", (left + W - right) / 2,
                     H - 4, escape(xlabel));
    return s;
  }
};

std::string legend(const std::vector<std::string>& names) {
  std::string s = R"(<div class="legend">)";
  for (size_t i = 0; i < names.size(); ++i)
    s += fmt::format(R"(<span><i style="background:{}"></i>{}</span>)", kPalette[i % 10], escape(names[i]));
  return s + "</div>";
}

std::string figure(const std::string& id, const std::string& title, const std::string& svg_body,
                   const std::vector<std::string>& names) {
  return fmt::format(
      R"(<figure class="chart" data-chart="{}"><figcaption>{}</figcaption><svg viewBox="0 0 {} {}" width="{}" height="{}" role="img">{}</svg>{}</figure>)",
      id, escape(title), Frame::W, Frame::H, Frame::W, Frame::H, svg_body, legend(names));
}

// Lines (with point markers when there are few points) against a shared x axis.
std::string line_chart(const std::string& id, const std::string& title, const std::string& xlabel,
                       const std::vector<Series>& all, const std::function<std::string(double)>& yfmt = number) {
  std::vector<Series> series;
  for (const Series& s : all)
    if (!s.points.empty()) series.push_back(s);
  if (series.empty()) return "";
  Frame f{std::numeric_limits<double>::max(), std::numeric_limits<double>::lowest(), std::numeric_limits<double>::max(),
          std::numeric_limits<double>::lowest()};
  for (const Series& s : series)
    for (auto [x, y] : s.points) {
      f.x0 = std::min(f.x0, x), f.x1 = std::max(f.x1, x), f.y0 = std::min(f.y0, y), f.y1 = std::max(f.y1, y);
    }
  if (f.y0 > 0 && f.y0 < 0.5 * f.y1) f.y0 = 0;
  if (f.y1 == f.y0) f.y0 -= 0.5 * std::max(std::fabs(f.y0), 1e-12), f.y1 += 0.5 * std::max(std::fabs(f.y1), 1e-12);
  std::string body = f.axes(xlabel, yfmt);
  std::vector<std::string> names;
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    std::string d;
    for (auto [x, y] : s.points) d += fmt::format("{}{:.1f},{:.1f}", d.empty() ? "M" : " L", f.sx(x), f.sy(y));
    body += fmt::format(R"(<path class="series" data-points="{}" d="{}" stroke="{}" fill="none" stroke-width="2"/>)",
                        s.points.size(), d, kPalette[i % 10]);
    if (s.points.size() <= 60)
      for (auto [x, y] : s.points)
        body += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="3" fill="{}"><title>{}: {} at {}</title></circle>)",
                            f.sx(x), f.sy(y), kPalette[i % 10], escape(s.name), number(y), number(x));
    names.push_back(s.name);
  }
  return figure(id, title, body, names);
}

std::string bytes_text(double b) {
  return format_bytes(static_cast<size_t>(std::max(0.0, b)));
}

// The memory timeline: bytes per category stacked at each recorded phase, the planned peak
// drawn across.
std::string memory_chart(const std::vector<json>& timeline, std::optional<double> planned_peak,
                         std::optional<double> predicted_process) {
  if (timeline.empty()) return "";
  // Long runs keep every k-th step (or evaluation) whole, all its phases, for ~1200 samples at most.
  std::vector<std::vector<const json*>> groups;
  for (const json& r : timeline) {
    const bool same =
        !groups.empty() && (*groups.back()[0])["step"] == r["step"] && (*groups.back()[0])["stage"] == r["stage"];
    if (!same) groups.emplace_back();
    groups.back().push_back(&r);
  }
  const size_t stride = (timeline.size() + 1199) / 1200;
  std::vector<const json*> samples;
  for (size_t g = 0; g < groups.size(); g += stride) samples.insert(samples.end(), groups[g].begin(), groups[g].end());
  std::vector<std::string> categories;
  for (size_t c = 0; c < kNumCategories; ++c) {
    const std::string name(category_name(static_cast<Category>(c)));
    for (const json* s : samples)
      if (s->contains("bytes") && (*s)["bytes"].value(name, 0.0) > 0) {
        categories.push_back(name);
        break;
      }
  }
  const size_t n = samples.size();
  std::vector<std::vector<double>> top(categories.size(), std::vector<double>(n, 0));
  double ymax = std::max(planned_peak.value_or(0), predicted_process.value_or(0));
  for (size_t i = 0; i < n; ++i) {
    double acc = 0;
    for (size_t k = 0; k < categories.size(); ++k) {
      acc += (*samples[i])["bytes"].value(categories[k], 0.0);
      top[k][i] = acc;
    }
    ymax = std::max({ymax, acc, (*samples[i]).value("rss_bytes", 0.0)});
  }
  Frame f{0, static_cast<double>(std::max<size_t>(n, 2) - 1), 0, ymax * 1.05};
  std::string body =
      f.axes("recorded phase (step: forward, loss, backward, optimizer; eval: forward, loss)", bytes_text);
  for (size_t k = 0; k < categories.size(); ++k) {
    std::string d;
    for (size_t i = 0; i < n; ++i)
      d += fmt::format("{}{:.1f},{:.1f}", i ? " L" : "M", f.sx(static_cast<double>(i)), f.sy(top[k][i]));
    for (size_t i = n; i-- > 0;)
      d += fmt::format(" L{:.1f},{:.1f}", f.sx(static_cast<double>(i)), f.sy(k ? top[k - 1][i] : 0.0));
    body += fmt::format(R"(<path class="series area" data-points="{}" d="{} Z" fill="{}" fill-opacity="0.8"/>)", n, d,
                        kPalette[k % 10]);
  }
  // The process's resident memory sampled in each phase (measured, not planned).
  std::string rss;
  for (size_t i = 0; i < n; ++i)
    if (const double v = samples[i]->value("rss_bytes", 0.0); v > 0)
      rss += fmt::format("{}{:.1f},{:.1f}", rss.empty() ? "M" : " L", f.sx(static_cast<double>(i)), f.sy(v));
  if (!rss.empty())
    body += fmt::format(R"(<path class="rss" d="{}" fill="none" stroke="{}" stroke-width="1.5"/>)", rss,
                        kPalette[categories.size() % 10]);
  if (planned_peak) {
    body += fmt::format(
        R"(<line class="planned" x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}"/><text class="label" x="{}" y="{:.1f}" text-anchor="end">arena (planned) {}</text>)",
        Frame::left, f.sy(*planned_peak), Frame::W - Frame::right, f.sy(*planned_peak), Frame::W - Frame::right - 4,
        f.sy(*planned_peak) - 4, escape(bytes_text(*planned_peak)));
  }
  if (predicted_process) {
    body += fmt::format(
        R"(<line class="predicted" x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}"/><text class="label" x="{}" y="{:.1f}">process (predicted) {}</text>)",
        Frame::left, f.sy(*predicted_process), Frame::W - Frame::right, f.sy(*predicted_process), Frame::left + 4,
        f.sy(*predicted_process) - 4, escape(bytes_text(*predicted_process)));
  }
  if (!rss.empty()) categories.push_back("process RSS (measured)");
  return figure("memory", "Memory timeline (arena bytes in use by category; process RSS measured per phase)", body,
                categories);
}

std::string key_value_table(const json& object) {
  std::string s = "<table>";
  for (const auto& [key, value] : object.items())
    s += fmt::format("<tr><th>{}</th><td>{}</td></tr>", escape(key), escape(value_text(value)));
  return s + "</table>";
}

std::string plan_table(const json& memory) {
  std::string s;
  if (memory.contains("arena_bytes"))
    s += fmt::format("<p>Arena (planned) <b>{}</b> ({} bytes, peak phase {})", bytes_text(memory["arena_bytes"].get<double>()),
                     memory["arena_bytes"].get<size_t>(), escape(memory.value("peak_phase", "")));
  if (memory.contains("process_predicted_peak_bytes"))
    s += fmt::format("; process predicted before the run <b>{}</b> (peak stage {})",
                     bytes_text(memory["process_predicted_peak_bytes"].get<double>()),
                     escape(memory.value("/process_plan/peak_stage"_json_pointer, std::string())));
  if (memory.contains("process_peak_rss_bytes"))
    s += fmt::format("; measured: process peak resident memory <b>{}</b>, arena pages resident {} (phase {})",
                     bytes_text(memory["process_peak_rss_bytes"].get<double>()),
                     bytes_text(memory.value("arena_resident_bytes", 0.0)), escape(memory.value("arena_resident_phase", "")));
  if (memory.contains("heap_allocations_during_steps"))
    s += fmt::format(", heap allocations inside steps after the first: {}",
                     memory["heap_allocations_during_steps"].value("count", 0));
  if (memory.value("host_arena_bytes", 0.0) > 0)
    s += fmt::format("; offloaded optimizer state in host memory {} (on the cpu backend host and device are the "
                     "same RAM: offload moves bytes between two accounts of it)",
                     bytes_text(memory["host_arena_bytes"].get<double>()));
  s += ".</p>";
  if (!memory.contains("table")) return s;
  // Phases in step order (JSON objects come back sorted by name).
  const json& table = memory["table"];
  std::vector<std::string> phases;
  for (size_t p = 0; p < kNumPhases; ++p)
    if (table.contains(std::string(phase_name(static_cast<Phase>(p)))))
      phases.emplace_back(phase_name(static_cast<Phase>(p)));
  s += "<table class=\"plan\"><tr><th>category</th>";
  for (const std::string& phase : phases) s += fmt::format("<th>{}</th>", escape(phase));
  s += "</tr>";
  for (size_t c = 0; c < kNumCategories; ++c) {
    const std::string name(category_name(static_cast<Category>(c)));
    s += fmt::format("<tr><th>{}</th>", escape(name));
    for (const std::string& phase : phases) s += fmt::format("<td>{}</td>", bytes_text(table[phase].value(name, 0.0)));
    s += "</tr>";
  }
  s += "<tr><th>total</th>";
  for (const std::string& phase : phases) {
    double total = 0;
    for (const auto& [name, bytes] : table[phase].items()) total += bytes.get<double>();
    s += fmt::format("<td><b>{}</b></td>", bytes_text(total));
  }
  return s + "</tr></table>";
}

constexpr const char* kStyle = R"(
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}
.charts{display:flex;flex-wrap:wrap;gap:16px}
figure.chart{margin:0;border:1px solid #ddd;border-radius:6px;padding:8px;background:#fff}
figcaption{font-weight:600;font-size:14px;margin-bottom:4px}
.axis{stroke:#444;stroke-width:1}.grid{stroke:#eee;stroke-width:1}
.tick,.label{font-size:11px;fill:#555}
.planned{stroke:#d00;stroke-width:1.5;stroke-dasharray:6 4}
.predicted{stroke:#333;stroke-width:1.5}
.legend{font-size:12px;display:flex;flex-wrap:wrap;gap:10px;max-width:640px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f6f6f6;text-align:left}
)";

// Measures every chart as rendered and records it, so a headless browser can be asked whether
// the charts are really there.
constexpr const char* kCheckScript = R"(
(function(){
  var charts=[].slice.call(document.querySelectorAll('figure.chart')).map(function(f){
    var svg=f.querySelector('svg'),r=svg.getBoundingClientRect(),w=0,h=0,points=0,series=f.querySelectorAll('.series');
    for(var i=0;i<series.length;i++){var b=series[i].getBBox();w=Math.max(w,b.width);h=Math.max(h,b.height);
      points+=parseInt(series[i].getAttribute('data-points')||'0',10);}
    return {id:f.getAttribute('data-chart'),series:series.length,points:points,data_width:w,data_height:h,
            width:r.width,height:r.height};
  });
  document.getElementById('render-check').textContent=JSON.stringify({charts:charts});
})();
)";

}  // namespace

std::string render_report(const fs::path& dir) {
  const std::vector<json> log = read_json_lines(dir / "log.jsonl");
  const std::vector<json> timeline = read_json_lines(dir / "memory.jsonl");
  const std::optional<json> memory = read_json_file_if_present(dir / "memory.json");
  const std::optional<json> arguments = read_json_file_if_present(dir / "run_args.json");
  const std::optional<json> eval_results = read_json_file_if_present(dir / "eval_results.json");
  if (log.empty() && timeline.empty() && !memory && !arguments && !eval_results)
    throw Error(fmt::format("{}: no run files (log.jsonl, memory.json, memory.jsonl, run_args.json, eval_results.json)",
                            dir.string()));

  Series loss{"training loss", {}}, eval_loss{"eval_loss", {}}, lr{"learning_rate", {}}, grad{"grad_norm", {}},
      speed{"tokens/s", {}};
  std::vector<Series> eval_metrics;
  json final_metrics = json::object();
  for (const json& r : log) {
    const double step = r.value("step", 0.0);
    auto add = [&](Series& s, const char* key) {
      if (r.contains(key) && r[key].is_number()) s.points.emplace_back(step, r[key].get<double>());
    };
    add(loss, "loss"), add(eval_loss, "eval_loss"), add(lr, "learning_rate"), add(grad, "grad_norm");
    add(speed, "tokens_per_second");
    for (const auto& [key, value] : r.items()) {
      if (!key.starts_with("eval_") || !value.is_number() || key == "eval_loss" || key == "eval_runtime" ||
          key == "eval_tokens" || key == "eval_examples")
        continue;
      // Named outside the structured binding: clang 14 does not yet let a lambda capture one.
      const std::string& name = key;
      auto it = std::find_if(eval_metrics.begin(), eval_metrics.end(), [&](const Series& s) { return s.name == name; });
      if (it == eval_metrics.end()) it = eval_metrics.insert(eval_metrics.end(), Series{name, {}});
      it->points.emplace_back(step, value.get<double>());
    }
    if (r.contains("loss") || r.contains("eval_loss"))
      for (const auto& [key, value] : r.items()) final_metrics[key] = value;
  }
  if (eval_results)
    for (const auto& [key, value] : eval_results->items())
      if (!value.is_structured()) final_metrics[key] = value;

  std::string charts;
  charts += line_chart("loss", "Loss", "step", {loss, eval_loss});
  charts += line_chart("eval_metrics", "Evaluation metrics", "step", eval_metrics);
  charts += line_chart("learning_rate", "Learning rate", "step", {lr});
  charts += line_chart("grad_norm", "Gradient norm (before clipping)", "step", {grad});
  charts += line_chart("tokens_per_second", "Throughput (tokens/s)", "step", {speed});
  std::optional<double> planned;
  if (memory && memory->contains("arena_bytes")) planned = (*memory)["arena_bytes"].get<double>();
  std::optional<double> predicted;
  if (memory && memory->contains("process_predicted_peak_bytes"))
    predicted = (*memory)["process_predicted_peak_bytes"].get<double>();
  charts += memory_chart(timeline, planned, predicted);

  std::string html = fmt::format(
      "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>memtune report: {}</title>"
      "<style>{}</style></head><body>\n<h1>memtune run report</h1><p>{}</p>\n",
      escape(dir.filename().string()), kStyle, escape(fs::absolute(dir).string()));
  if (!final_metrics.empty()) html += "<h2>Final metrics</h2>" + key_value_table(final_metrics) + "\n";
  if (!charts.empty()) html += "<h2>Charts</h2><div class=\"charts\">" + charts + "</div>\n";
  if (memory) html += "<h2>Memory plan (bytes live per phase)</h2>" + plan_table(*memory) + "\n";
  if (arguments) html += "<h2>Arguments</h2>" + key_value_table(*arguments) + "\n";
  html +=
      "<pre id=\"render-check\" hidden></pre>\n<script>" + std::string(kCheckScript) + "</script>\n</body></html>\n";
  return html;
}

fs::path write_report(const fs::path& dir) {
  const fs::path path = dir / "report.html";
  write_file_atomically(path.string(), render_report(dir));
  return path;
}

}  // namespace memtune
