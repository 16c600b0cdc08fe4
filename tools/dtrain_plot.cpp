// dtrain-plot: loss and tokens/s against steps from one or more --metrics files, as one SVG.
//
//   build/bin/dtrain-plot -o run.svg m.jsonl                 # one run
//   build/bin/dtrain-plot -o cmp.svg ddp.jsonl fsdp.jsonl    # runs side by side, one colour each
//
// Reads the per-step lines ("step", "loss", "tokens_per_s"); the "final" line is skipped.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

struct Series {
  std::string name;
  std::vector<double> step, loss, tokens;
};

Series read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  Series s;
  s.name = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ":" + std::to_string(n) + ": not a JSON line (" + e.what() + ")");
    }
    if (j.value("final", false) || !j.contains("step") || !j.contains("loss")) continue;
    // A diverged step has "loss": null (NaN is not JSON): a gap in the line, not an error.
    auto num = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : std::nan(""); };
    if (!j["step"].is_number()) continue;
    s.step.push_back(j["step"].get<double>());
    s.loss.push_back(num("loss"));
    s.tokens.push_back(num("tokens_per_s"));
  }
  if (s.step.empty()) throw std::runtime_error(path + ": no step lines (a --metrics file of dtrain-gpt or train::fit)");
  return s;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, std::abs(v) >= 1e4 ? "%.3g" : "%.4g", v);
  return b;
}

// One panel: x = step, y = `pick`, at (x0, y0) of size w x h.
void panel(std::ostringstream& svg, const std::vector<Series>& runs, const char* title,
           std::vector<double> Series::*pick, double x0, double y0, double w, double h) {
  static const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  double xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = -1e300;
  for (const auto& r : runs) {
    for (size_t i = 0; i < r.step.size(); ++i) {
      const double y = (r.*pick)[i];
      if (!std::isfinite(y)) continue;
      xmin = std::min(xmin, r.step[i]);
      xmax = std::max(xmax, r.step[i]);
      ymin = std::min(ymin, y);
      ymax = std::max(ymax, y);
    }
  }
  if (xmin > xmax) {  // no finite value in any run: an empty panel
    svg << "<text x=\"" << x0 + w / 2 << "\" y=\"" << y0 + h / 2 << "\" text-anchor=\"middle\">" << title
        << ": no finite values</text>\n";
    return;
  }
  if (xmax <= xmin) xmax = xmin + 1;
  if (ymax <= ymin) ymax = ymin + 1;
  const double pad = 0.05 * (ymax - ymin);
  ymin -= pad;
  ymax += pad;
  auto X = [&](double x) { return x0 + 60 + (w - 80) * (x - xmin) / (xmax - xmin); };
  auto Y = [&](double y) { return y0 + h - 30 - (h - 60) * (y - ymin) / (ymax - ymin); };
  svg << "<text x=\"" << x0 + w / 2 << "\" y=\"" << y0 + 18 << "\" text-anchor=\"middle\" font-size=\"14\">" << title
      << "</text>\n";
  svg << "<rect x=\"" << X(xmin) << "\" y=\"" << Y(ymax) << "\" width=\"" << X(xmax) - X(xmin) << "\" height=\""
      << Y(ymin) - Y(ymax) << "\" fill=\"none\" stroke=\"#888\"/>\n";
  for (int k = 0; k <= 4; ++k) {
    const double yv = ymin + (ymax - ymin) * k / 4, xv = xmin + (xmax - xmin) * k / 4;
    svg << "<text x=\"" << X(xmin) - 4 << "\" y=\"" << Y(yv) + 4 << "\" text-anchor=\"end\" font-size=\"10\">" << fmt(yv)
        << "</text>\n";
    svg << "<text x=\"" << X(xv) << "\" y=\"" << Y(ymin) + 14 << "\" text-anchor=\"middle\" font-size=\"10\">"
        << fmt(xv) << "</text>\n";
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    svg << "<polyline class=\"series\" fill=\"none\" stroke-width=\"1.5\" stroke=\"" << colours[r % 6] << "\" points=\"";
    for (size_t i = 0; i < runs[r].step.size(); ++i) {
      const double y = (runs[r].*pick)[i];
      if (std::isfinite(y)) svg << X(runs[r].step[i]) << "," << Y(y) << " ";
    }
    svg << "\"/>\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = "metrics.svg";
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << "usage: dtrain-plot [-o OUT.svg] METRICS.jsonl...\n"
                   "Plots loss and tokens/s against steps of each --metrics file (one colour per file).\n";
      return 0;
    }
    if (a == "-o") {
      if (i + 1 >= argc) {
        std::cerr << "dtrain-plot: -o needs a file name\n";
        return 2;
      }
      out = argv[++i];
    } else {
      inputs.push_back(a);
    }
  }
  if (inputs.empty()) {
    std::cerr << "dtrain-plot: no metrics file given (usage: dtrain-plot [-o OUT.svg] METRICS.jsonl...)\n";
    return 2;
  }
  try {
    std::vector<Series> runs;
    for (const auto& p : inputs) runs.push_back(read_metrics(p));
    const double w = 900, h = 320;
    std::ostringstream svg;
    svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << 2 * h + 20 + 18 * runs.size()
        << "\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    panel(svg, runs, "loss", &Series::loss, 0, 0, w, h);
    panel(svg, runs, "tokens/s", &Series::tokens, 0, h, w, h);
    static const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
    for (size_t r = 0; r < runs.size(); ++r) {
      svg << "<text x=\"60\" y=\"" << 2 * h + 14 + 18 * r << "\" font-size=\"12\" fill=\"" << colours[r % 6] << "\">"
          << xml_escape(runs[r].name) << " (" << runs[r].step.size() << " steps)</text>\n";
    }
    svg << "</svg>\n";
    std::ofstream f(out);
    f << svg.str();
    if (!f.good()) throw std::runtime_error("cannot write " + out);
    std::cout << "dtrain-plot: wrote " << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "dtrain-plot: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
