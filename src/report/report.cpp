#include "report/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cctype>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
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

// The smallest and largest finite value seen.
struct Extent {
  double lo = std::numeric_limits<double>::max(), hi = std::numeric_limits<double>::lowest();
  void add(double v) {
    if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

// Geometry shared by the charts: a plot area inside margins and linear scales whose ends are the
// outer ticks of 1-2-5 axes (steps on x, values on y). The viewBox is about as wide as the page's
// content, so the text keeps its size when a chart is stretched to the full width.
struct Frame {
  static constexpr double W = 1200, H = 300, left = 84, right = 20, top = 16, bottom = 40;
  AxisTicks xt, yt;
  double y_scale = 1;  // data units per axis unit (bytes per MiB on the memory chart)
  std::string y_unit;  // after every value-axis label

  Frame(const Extent& x, const Extent& y, double scale = 1, std::string unit = {})
      : xt(nice_ticks(x.lo, x.hi, 11, true)), yt(nice_ticks(y.lo / scale, y.hi / scale, 8)), y_scale(scale),
        y_unit(std::move(unit)) {}
  double x0() const { return xt.values.front(); }
  double x1() const { return xt.values.back(); }
  double y0() const { return yt.values.front() * y_scale; }
  double y1() const { return yt.values.back() * y_scale; }
  double sx(double x) const { return left + (x - x0()) / (x1() - x0()) * (W - left - right); }
  double sy(double y) const { return H - bottom - (y - y0()) / (y1() - y0()) * (H - top - bottom); }
  std::string axes(const std::string& xlabel) const {
    std::string s;
    for (double v : yt.values) {
      const double y = sy(v * y_scale);
      s += fmt::format(R"(<line class="grid" x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}"/>)", left, y, W - right, y);
      s += fmt::format(R"(<text class="tick" x="{}" y="{:.1f}" text-anchor="end">{}{}</text>)", left - 6, y + 4,
                       escape(tick_label(v, yt.step)), y_unit.empty() ? "" : fmt::format(" {}", escape(y_unit)));
    }
    for (double v : xt.values) {
      const double x = sx(v);
      s += fmt::format(R"(<line class="grid" x1="{:.1f}" y1="{}" x2="{:.1f}" y2="{}"/>)", x, top, x, H - bottom);
      s += fmt::format(R"(<line class="axis" x1="{:.1f}" y1="{}" x2="{:.1f}" y2="{}"/>)", x, H - bottom, x,
                       H - bottom + 4);
      s += fmt::format(R"(<text class="tick" x="{:.1f}" y="{}" text-anchor="middle">{}</text>)", x, H - bottom + 17,
                       escape(tick_label(v, xt.step)));
    }
    s += fmt::format(
        R"(<line class="axis" x1="{0}" y1="{1}" x2="{2}" y2="{1}"/><line class="axis" x1="{0}" y1="{3}" x2="{0}" y2="{1}"/>)",
        left, H - bottom, W - right, top);
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
      R"(<figure class="chart" data-chart="{}"><figcaption>{}</figcaption><svg viewBox="0 0 {} {}" data-plot-top="{}" data-plot-bottom="{}" role="img" aria-label="{}">{}</svg>{}</figure>)",
      id, escape(title), Frame::W, Frame::H, Frame::top, Frame::H - Frame::bottom, escape(title), svg_body,
      legend(names));
}

// The frame of a line chart: steps on x, the values' range on y (from 0 when the values start
// below half their maximum, unless zero_anchor is false).
Frame line_frame(const std::vector<Series>& series, bool zero_anchor) {
  Extent x, y;
  for (const Series& s : series)
    for (auto [px, py] : s.points) x.add(px), y.add(py);
  if (x.empty()) x = {0, 1};
  if (y.empty()) y = {0, 1};
  if (zero_anchor && y.lo > 0 && y.lo < 0.5 * y.hi) y.lo = 0;
  return Frame(x, y);
}

// Lines (with point markers when there are few points) against a shared x axis.
std::string line_chart(const std::string& id, const std::string& title, const std::string& xlabel,
                       const std::vector<Series>& all, bool zero_anchor = true) {
  std::vector<Series> series;
  for (const Series& s : all)
    if (!s.points.empty()) series.push_back(s);
  if (series.empty()) return "";
  const Frame f = line_frame(series, zero_anchor);
  std::string body = f.axes(xlabel);
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

// The loss after warm-up. The first logged losses (about ln(vocabulary size): 12 for a 151936-token
// vocabulary, against ~1 later) stretch the loss chart's value axis until the rest of the curve is
// a flat line at its bottom. This panel leaves out the first tenth of the steps and fits its value
// axis to what follows; it is drawn only when those later losses fill less than half of the loss
// chart's height.
std::string loss_after_warmup_chart(const Series& loss, const Series& eval_loss) {
  if (loss.points.size() < 10) return "";
  Extent steps;
  for (auto [x, y] : loss.points) steps.add(x);
  const double cutoff = steps.lo + 0.1 * (steps.hi - steps.lo);
  auto later = [&](const Series& s) {
    Series out{s.name, {}};
    for (auto [x, y] : s.points)
      if (x > cutoff) out.points.emplace_back(x, y);
    return out;
  };
  const Series late_loss = later(loss), late_eval = later(eval_loss);
  if (late_loss.points.size() < 3) return "";
  Extent late;
  for (const Series* s : {&late_loss, &late_eval})
    for (auto [x, y] : s->points) late.add(y);
  const Frame whole = line_frame({loss, eval_loss}, true);
  if (late.hi - late.lo >= 0.5 * (whole.y1() - whole.y0())) return "";
  Extent late_steps;
  for (auto [x, y] : late_loss.points) late_steps.add(x);
  return line_chart("loss_after_warmup",
                    fmt::format("Loss after warm-up (from step {}; the first tenth of the steps left out)",
                                number(late_steps.lo)),
                    "step", {late_loss, late_eval}, false);
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
  // The value axis in the largest binary unit the peak reaches.
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  size_t unit = 0;
  double scale = 1;
  while (unit + 1 < std::size(kUnits) && ymax >= 1024 * scale) scale *= 1024, ++unit;
  const Frame f(Extent{0, static_cast<double>(std::max<size_t>(n, 2) - 1)}, Extent{0, ymax}, scale, kUnits[unit]);
  std::string body = f.axes("recorded phase (step: forward, loss, backward, optimizer; eval: forward, loss)");
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

// A metric's cell: its value in units for people, the number as logged on hover when it differs.
std::string metric_cell(const std::string& key, const json& value) {
  if (!value.is_number()) return fmt::format("<td>{}</td>", escape(value_text(value)));
  const std::string shown = metric_text(key, value.get<double>());
  const std::string exact = value.is_number_float() && key.ends_with("_bytes")
                                ? fmt::format("{:.0f}", value.get<double>())
                                : value.dump();
  if (shown == exact) return fmt::format("<td>{}</td>", escape(shown));
  const bool seconds = key.find("runtime") != std::string::npos || key.ends_with("_seconds");
  const char* unit = key.ends_with("_bytes") ? " bytes" : seconds ? " seconds" : "";
  return fmt::format(R"(<td title="{}{}">{}</td>)", escape(exact), unit, escape(shown));
}

// The final metrics in their groups (Training, Evaluation, Memory, Speed), each a heading and a
// table; loss and eval_loss lead their groups, the rest follow by name. Every key is shown.
std::string metrics_section(const json& metrics, const std::set<std::string>& from_eval_results) {
  static constexpr std::string_view kGroups[] = {"Training", "Evaluation", "Memory", "Speed"};
  std::string s = R"(<div class="metrics">)";
  for (const std::string_view group : kGroups) {
    std::vector<std::string> keys;
    for (const auto& [key, value] : metrics.items())
      if (metric_group(key, from_eval_results.count(key) > 0) == group) keys.push_back(key);
    if (keys.empty()) continue;
    std::stable_partition(keys.begin(), keys.end(),
                          [](const std::string& key) { return key == "loss" || key == "eval_loss"; });
    std::string id(group);
    std::transform(id.begin(), id.end(), id.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    s += fmt::format(R"(<section class="group" data-group="{}"><h3>{}</h3><table>)", id, group);
    for (const std::string& key : keys)
      s += fmt::format("<tr><th>{}</th>{}</tr>", escape(key), metric_cell(key, metrics[key]));
    s += "</table></section>";
  }
  return s + "</div>";
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
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1280px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}h3{font-size:14px;margin:8px 0 4px}
.charts{display:flex;flex-direction:column;gap:16px}
figure.chart{margin:0;border:1px solid #ddd;border-radius:6px;padding:8px;background:#fff}
figure.chart svg{display:block;width:100%;height:auto}
figcaption{font-weight:600;font-size:14px;margin-bottom:4px}
.axis{stroke:#444;stroke-width:1}.grid{stroke:#eee;stroke-width:1}
.tick,.label{font-size:12px;fill:#555}
.planned{stroke:#d00;stroke-width:1.5;stroke-dasharray:6 4}
.predicted{stroke:#333;stroke-width:1.5}
.legend{font-size:12px;display:flex;flex-wrap:wrap;gap:10px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
.metrics{display:flex;flex-wrap:wrap;gap:4px 40px;align-items:flex-start}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f6f6f6;text-align:left}
td[title]{text-decoration:underline dotted #999}
)";

// Measures the page as rendered and records it, so a headless browser can be asked whether the
// charts are really there and span the content, and which metric groups are shown.
constexpr const char* kCheckScript = R"(
(function(){
  var content=document.body.getBoundingClientRect().width;
  var charts=[].slice.call(document.querySelectorAll('figure.chart')).map(function(f){
    var svg=f.querySelector('svg'),r=svg.getBoundingClientRect(),w=0,h=0,points=0,series=f.querySelectorAll('.series');
    for(var i=0;i<series.length;i++){var b=series[i].getBBox();w=Math.max(w,b.width);h=Math.max(h,b.height);
      points+=parseInt(series[i].getAttribute('data-points')||'0',10);}
    return {id:f.getAttribute('data-chart'),series:series.length,points:points,data_width:w,data_height:h,
            width:r.width,height:r.height,figure_width:f.getBoundingClientRect().width};
  });
  var groups=[].slice.call(document.querySelectorAll('.metrics h3')).filter(function(h){
    return h.getBoundingClientRect().height>0;}).map(function(h){return h.textContent;});
  var metrics=document.querySelector('.metrics');
  document.getElementById('render-check').textContent=JSON.stringify({content_width:content,charts:charts,
    metric_groups:groups,metrics_text:metrics?metrics.innerText:''});
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
  std::set<std::string> from_eval_results;
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
      if (!value.is_structured()) final_metrics[key] = value, from_eval_results.insert(key);

  std::string charts;
  charts += line_chart("loss", "Loss", "step", {loss, eval_loss});
  charts += loss_after_warmup_chart(loss, eval_loss);
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
  if (!final_metrics.empty())
    html += "<h2>Final metrics</h2>" + metrics_section(final_metrics, from_eval_results) + "\n";
  if (!charts.empty()) html += "<h2>Charts</h2><div class=\"charts\">" + charts + "</div>\n";
  if (memory) html += "<h2>Memory plan (bytes live per phase)</h2>" + plan_table(*memory) + "\n";
  if (arguments) html += "<h2>Arguments</h2>" + key_value_table(*arguments) + "\n";
  html +=
      "<pre id=\"render-check\" hidden></pre>\n<script>" + std::string(kCheckScript) + "</script>\n</body></html>\n";
  return html;
}

AxisTicks nice_ticks(double lo, double hi, int max_ticks, bool integer) {
  max_ticks = std::max(max_ticks, 2);
  if (!std::isfinite(hi - lo)) lo = 0, hi = 1;  // also a NaN or infinite end
  if (lo > hi) std::swap(lo, hi);
  if (hi - lo <= 1e-12 * std::max(std::fabs(lo), std::fabs(hi))) {  // one value: an axis around it
    const double pad = integer || lo == 0 ? 1.0 : 0.1 * std::fabs(lo);
    lo -= pad, hi += pad;
  }
  // Starting a decade below (hi - lo) / max_ticks, the first candidate always has too many ticks.
  static constexpr double kMantissas[] = {1, 2, 5};
  for (int exponent = static_cast<int>(std::floor(std::log10((hi - lo) / max_ticks))) - 1;; ++exponent)
    for (const double mantissa : kMantissas) {
      // Negative powers as a division: 2 / 10 is the double nearest 0.2, 2 * 0.1 is not.
      const double step =
          exponent >= 0 ? mantissa * std::pow(10.0, exponent) : mantissa / std::pow(10.0, -exponent);
      if (integer && step < 1) continue;
      const double first = std::floor(lo / step + 1e-9), last = std::ceil(hi / step - 1e-9);
      if (last - first + 1 > max_ticks) continue;
      AxisTicks ticks{step, {}};
      for (double i = first; i <= last; ++i) ticks.values.push_back(i * step);
      return ticks;
    }
}

namespace {

// "0.500" -> "0.5", "2.000" -> "2"; text without a point is kept.
std::string trim_zeros(std::string text) {
  if (text.find('.') == std::string::npos) return text;
  while (text.back() == '0') text.pop_back();
  if (text.back() == '.') text.pop_back();
  return text;
}

// 1234567 -> "1,234,567".
std::string group_digits(double whole) {
  const std::string digits = fmt::format("{:.0f}", std::fabs(whole));
  std::string out = whole < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

std::string tick_label(double value, double step) {
  if (!(step > 0) || !std::isfinite(value)) return number(value);
  value = std::round(value / step) * step;
  if (std::fabs(value) < 1e-6 * step) return "0";
  const int step_exponent = static_cast<int>(std::floor(std::log10(step) + 1e-9));
  if (step_exponent < -4 || std::fabs(value) >= 1e7) {
    const int exponent = static_cast<int>(std::floor(std::log10(std::fabs(value)) + 1e-9));
    return fmt::format("{}e{}",
                       trim_zeros(fmt::format("{:.{}f}", value / std::pow(10.0, exponent),
                                              std::max(0, exponent - step_exponent))),
                       exponent);
  }
  return trim_zeros(fmt::format("{:.{}f}", value, std::max(0, -step_exponent)));
}

std::string format_seconds(double seconds) {
  if (!std::isfinite(seconds)) return fmt::format("{} s", seconds);
  if (seconds < 0) return fmt::format("-{}", format_seconds(-seconds));
  if (seconds == 0) return "0 s";
  if (seconds < 0.9995) return fmt::format("{:.3g} ms", seconds * 1000);
  if (seconds < 59.95) return fmt::format("{:.3g} s", seconds);
  const int64_t whole = std::llround(seconds);
  if (whole < 3600) return fmt::format("{} min {} s", whole / 60, whole % 60);
  const int64_t minutes = std::llround(seconds / 60);
  return fmt::format("{} h {} min", minutes / 60, minutes % 60);
}

std::string_view metric_group(std::string_view key, bool from_eval_results) {
  auto has = [&](std::string_view part) { return key.find(part) != std::string_view::npos; };
  if (key.ends_with("_bytes") || has("memory")) return "Memory";
  if (has("runtime") || key.ends_with("_seconds") || has("per_second") || key.ends_with("_clock")) return "Speed";
  if (key.starts_with("eval_") || from_eval_results) return "Evaluation";
  return "Training";
}

std::string metric_text(std::string_view key, double value) {
  if (!std::isfinite(value)) return number(value);
  if (key.ends_with("_bytes") && value >= 0 && value < 9e18)
    return format_bytes(static_cast<size_t>(std::llround(value)));
  if (const size_t per = key.find("_per_second"); per != std::string_view::npos) {
    // What is counted: the word before "_per_second" ("eval_samples_per_second" -> samples/s).
    const std::string_view before = key.substr(0, per);
    const size_t underscore = before.rfind('_');
    const std::string_view what = underscore == std::string_view::npos ? before : before.substr(underscore + 1);
    return fmt::format("{} {}/s", value >= 100 ? group_digits(std::round(value)) : fmt::format("{:.3g}", value),
                       what);
  }
  if (key.find("runtime") != std::string_view::npos || key.ends_with("_seconds")) return format_seconds(value);
  if (value == std::floor(value) && std::fabs(value) < 1e15) return group_digits(value);
  return fmt::format("{:.4g}", value);
}

fs::path write_report(const fs::path& dir) {
  const fs::path path = dir / "report.html";
  write_file_atomically(path.string(), render_report(dir));
  return path;
}

}  // namespace memtune
