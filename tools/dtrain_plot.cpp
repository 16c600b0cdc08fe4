// dtrain-plot: loss and tokens/s against steps from one or more --metrics files, as one SVG or PNG
// (by the output's extension).
//
//   build/bin/dtrain-plot -o run.svg m.jsonl                 # one run
//   build/bin/dtrain-plot -o cmp.png ddp.jsonl fsdp.jsonl    # runs side by side, one colour each
//
// Reads the per-step lines ("step", "loss", "tokens_per_s"); the "final" line is skipped. The PNG is
// drawn here (lines, a 3x5 pixel font of our own, stored deflate blocks): no image library needed.
#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
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

const char* const kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};

// What a plot is drawn with; SVG and PNG implement it.
class Canvas {
 public:
  enum class Anchor { Start, Middle, End };
  virtual ~Canvas() = default;
  // Text whose baseline starts, is centred or ends at (x, y); `size` in pixels.
  virtual void text(double x, double y, const std::string& s, Anchor a, int size, const char* colour) = 0;
  virtual void frame(double x, double y, double w, double h) = 0;  // a grey rectangle outline
  // A line through the points (x0 y0 x1 y1 ...), 1.5 px wide.
  virtual void polyline(const std::vector<double>& xy, const char* colour) = 0;
  virtual void save(const std::string& path) = 0;
};

class SvgCanvas : public Canvas {
 public:
  SvgCanvas(double w, double h) {
    svg_ << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << h
         << "\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  }
  void text(double x, double y, const std::string& s, Anchor a, int size, const char* colour) override {
    static const char* anchors[] = {"start", "middle", "end"};
    svg_ << "<text x=\"" << x << "\" y=\"" << y << "\" text-anchor=\"" << anchors[static_cast<int>(a)]
         << "\" font-size=\"" << size << "\" fill=\"" << colour << "\">" << xml_escape(s) << "</text>\n";
  }
  void frame(double x, double y, double w, double h) override {
    svg_ << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << h
         << "\" fill=\"none\" stroke=\"#888\"/>\n";
  }
  void polyline(const std::vector<double>& xy, const char* colour) override {
    svg_ << "<polyline class=\"series\" fill=\"none\" stroke-width=\"1.5\" stroke=\"" << colour << "\" points=\"";
    for (size_t i = 0; i + 1 < xy.size(); i += 2) svg_ << xy[i] << "," << xy[i + 1] << " ";
    svg_ << "\"/>\n";
  }
  void save(const std::string& path) override {
    std::ofstream f(path);
    f << svg_.str() << "</svg>\n";
    if (!f.good()) throw std::runtime_error("cannot write " + path);
  }

 private:
  std::ostringstream svg_;
};

// A 3x5 pixel font (rows top to bottom, '#' set), drawn at 2x: upper case, digits and what numbers
// and file names need; lower case is drawn as upper case, anything else as a box.
const char* glyph(char c) {
  static const std::pair<char, const char*> font[] = {
      {'A', ".#.#.#####.##.#"}, {'B', "##.#.###.#.###."}, {'C', ".###..#..#...##"}, {'D', "##.#.##.##.###."},
      {'E', "####..##.#..###"}, {'F', "####..##.#..#.."}, {'G', ".###..#.##.#.##"}, {'H', "#.##.#####.##.#"},
      {'I', "###.#..#..#.###"}, {'J', "..#..#..##.#.#."}, {'K', "#.##.###.#.##.#"}, {'L', "#..#..#..#..###"},
      {'M', "#.########.##.#"}, {'N', "##.#.##.##.##.#"}, {'O', ".#.#.##.##.#.#."}, {'P', "##.#.###.#..#.."},
      {'Q', ".#.#.##.###..##"}, {'R', "##.#.###.#.##.#"}, {'S', ".###...#...###."}, {'T', "###.#..#..#..#."},
      {'U', "#.##.##.##.####"}, {'V', "#.##.##.##.#.#."}, {'W', "#.##.########.#"}, {'X', "#.##.#.#.#.##.#"},
      {'Y', "#.##.#.#..#..#."}, {'Z', "###..#.#.#..###"}, {'0', "####.##.##.####"}, {'1', ".#.##..#..#.###"},
      {'2', "##...#.#.#..###"}, {'3', "##...#.#...###."}, {'4', "#.##.####..#..#"}, {'5', "####..##...###."},
      {'6', ".###..####.####"}, {'7', "###..#.#..#..#."}, {'8', "####.#####.####"}, {'9', "####.####..###."},
      {'.', ".............#."}, {'-', "......###......"}, {'+', "....#.###.#...."}, {'/', "..#..#.#.#..#.."},
      {'_', "............###"}, {'(', ".#.#..#..#...#."}, {')', ".#...#..#..#.#."}, {',', "..........#.#.."},
      {':', "....#.....#...."}, {' ', "..............."}, {'&', ".#.#.#.#.#.#.##"}, {'=', "...###...###..."},
  };
  if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  for (const auto& g : font) {
    if (g.first == c) return g.second;
  }
  return "####.##.##.####";
}

class PngCanvas : public Canvas {
 public:
  PngCanvas(int w, int h) : w_(w), h_(h), rgb_(static_cast<size_t>(w) * h * 3, 255) {}

  void text(double x, double y, const std::string& s, Anchor a, int size, const char* colour) override {
    const int scale = size >= 14 ? 3 : 2, advance = 4 * scale;
    const int width = static_cast<int>(s.size()) * advance - scale;
    int x0 = static_cast<int>(x) - (a == Anchor::Middle ? width / 2 : a == Anchor::End ? width : 0);
    const int y0 = static_cast<int>(y) - 5 * scale;  // the baseline is the glyphs' bottom
    const auto rgb = parse(colour);
    for (char c : s) {
      const char* g = glyph(c);
      for (int r = 0; r < 5; ++r) {
        for (int k = 0; k < 3; ++k) {
          if (g[r * 3 + k] == '#') fill(x0 + k * scale, y0 + r * scale, scale, scale, rgb);
        }
      }
      x0 += advance;
    }
  }
  void frame(double x, double y, double w, double h) override {
    const std::array<uint8_t, 3> grey{0x88, 0x88, 0x88};
    line(x, y, x + w, y, grey, 1);
    line(x + w, y, x + w, y + h, grey, 1);
    line(x + w, y + h, x, y + h, grey, 1);
    line(x, y + h, x, y, grey, 1);
  }
  void polyline(const std::vector<double>& xy, const char* colour) override {
    const auto rgb = parse(colour);
    for (size_t i = 0; i + 3 < xy.size(); i += 2) line(xy[i], xy[i + 1], xy[i + 2], xy[i + 3], rgb, 2);
    if (xy.size() == 2) fill(static_cast<int>(xy[0]) - 1, static_cast<int>(xy[1]) - 1, 3, 3, rgb);
  }
  void save(const std::string& path) override;

 private:
  static std::array<uint8_t, 3> parse(const char* hex) {  // "#rrggbb"
    const unsigned v = static_cast<unsigned>(std::stoul(std::string(hex + 1), nullptr, 16));
    return {static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v)};
  }
  void fill(int x, int y, int w, int h, const std::array<uint8_t, 3>& rgb) {
    for (int j = std::max(y, 0); j < std::min(y + h, h_); ++j) {
      for (int i = std::max(x, 0); i < std::min(x + w, w_); ++i) {
        std::copy(rgb.begin(), rgb.end(), rgb_.begin() + (static_cast<size_t>(j) * w_ + i) * 3);
      }
    }
  }
  void line(double x0, double y0, double x1, double y1, const std::array<uint8_t, 3>& rgb, int width) {
    const int n = static_cast<int>(std::ceil(std::max(std::abs(x1 - x0), std::abs(y1 - y0)))) + 1;
    for (int k = 0; k <= n; ++k) {
      const double t = static_cast<double>(k) / n;
      fill(static_cast<int>(std::lround(x0 + t * (x1 - x0))) - width / 2,
           static_cast<int>(std::lround(y0 + t * (y1 - y0))) - width / 2, width, width, rgb);
    }
  }
  int w_, h_;
  std::vector<uint8_t> rgb_;
};

uint32_t crc32(const uint8_t* p, size_t n, uint32_t crc = 0) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void put32(std::string& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out += static_cast<char>((v >> s) & 0xFF);
}

void chunk(std::string& png, const char* type, const std::string& data) {
  put32(png, static_cast<uint32_t>(data.size()));
  const std::string body = std::string(type, 4) + data;
  png += body;
  put32(png, crc32(reinterpret_cast<const uint8_t*>(body.data()), body.size()));
}

// PNG: 8-bit RGB, each row filter 0, the zlib stream in stored (uncompressed) deflate blocks.
void PngCanvas::save(const std::string& path) {
  std::string raw;
  raw.reserve(static_cast<size_t>(h_) * (w_ * 3 + 1));
  for (int j = 0; j < h_; ++j) {
    raw += '\0';
    raw.append(reinterpret_cast<const char*>(rgb_.data()) + static_cast<size_t>(j) * w_ * 3, static_cast<size_t>(w_) * 3);
  }
  std::string z = "\x78\x01";
  for (size_t at = 0; at < raw.size() || at == 0; at += 65535) {
    const size_t n = std::min<size_t>(65535, raw.size() - at);
    z += static_cast<char>(at + n >= raw.size() ? 1 : 0);  // BFINAL on the last block, BTYPE 00
    z += static_cast<char>(n & 0xFF);
    z += static_cast<char>(n >> 8);
    z += static_cast<char>(~n & 0xFF);
    z += static_cast<char>((~n >> 8) & 0xFF);
    z.append(raw, at, n);
    if (raw.empty()) break;
  }
  uint32_t a = 1, b = 0;  // Adler-32 of the uncompressed data
  for (unsigned char c : raw) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  put32(z, (b << 16) | a);
  std::string ihdr;
  put32(ihdr, static_cast<uint32_t>(w_));
  put32(ihdr, static_cast<uint32_t>(h_));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8 bits, RGB, deflate, filter 0, no interlace
  std::string png = "\x89PNG\r\n\x1a\n";
  chunk(png, "IHDR", ihdr);
  chunk(png, "IDAT", z);
  chunk(png, "IEND", "");
  std::ofstream f(path, std::ios::binary);
  f << png;
  if (!f.good()) throw std::runtime_error("cannot write " + path);
}

// One panel: x = step, y = `pick`, at (x0, y0) of size w x h.
void panel(Canvas& c, const std::vector<Series>& runs, const char* title, std::vector<double> Series::*pick, double x0,
           double y0, double w, double h) {
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
    c.text(x0 + w / 2, y0 + h / 2, std::string(title) + ": no finite values", Canvas::Anchor::Middle, 12, "#000000");
    return;
  }
  if (xmax <= xmin) xmax = xmin + 1;
  if (ymax <= ymin) ymax = ymin + 1;
  const double pad = 0.05 * (ymax - ymin);
  ymin -= pad;
  ymax += pad;
  auto X = [&](double x) { return x0 + 60 + (w - 80) * (x - xmin) / (xmax - xmin); };
  auto Y = [&](double y) { return y0 + h - 30 - (h - 60) * (y - ymin) / (ymax - ymin); };
  c.text(x0 + w / 2, y0 + 18, title, Canvas::Anchor::Middle, 14, "#000000");
  c.frame(X(xmin), Y(ymax), X(xmax) - X(xmin), Y(ymin) - Y(ymax));
  for (int k = 0; k <= 4; ++k) {
    const double yv = ymin + (ymax - ymin) * k / 4, xv = xmin + (xmax - xmin) * k / 4;
    c.text(X(xmin) - 4, Y(yv) + 4, fmt(yv), Canvas::Anchor::End, 10, "#000000");
    c.text(X(xv), Y(ymin) + 14, fmt(xv), Canvas::Anchor::Middle, 10, "#000000");
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    std::vector<double> xy;
    for (size_t i = 0; i < runs[r].step.size(); ++i) {
      const double y = (runs[r].*pick)[i];
      if (!std::isfinite(y)) continue;
      xy.push_back(X(runs[r].step[i]));
      xy.push_back(Y(y));
    }
    c.polyline(xy, kColours[r % 6]);
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = "metrics.svg";
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << "usage: dtrain-plot [-o OUT.svg|OUT.png] METRICS.jsonl...\n"
                   "Plots loss and tokens/s against steps of each --metrics file (one colour per file),\n"
                   "as SVG, or PNG when OUT ends in .png.\n";
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
    std::cerr << "dtrain-plot: no metrics file given (usage: dtrain-plot [-o OUT.svg|OUT.png] METRICS.jsonl...)\n";
    return 2;
  }
  try {
    std::vector<Series> runs;
    for (const auto& p : inputs) runs.push_back(read_metrics(p));
    const double w = 900, h = 320, height = 2 * h + 20 + 18 * runs.size();
    std::unique_ptr<Canvas> canvas;
    if (ends_with(out, ".png")) {
      canvas = std::make_unique<PngCanvas>(static_cast<int>(w), static_cast<int>(height));
    } else {
      canvas = std::make_unique<SvgCanvas>(w, height);
    }
    panel(*canvas, runs, "loss", &Series::loss, 0, 0, w, h);
    panel(*canvas, runs, "tokens/s", &Series::tokens, 0, h, w, h);
    for (size_t r = 0; r < runs.size(); ++r) {
      canvas->text(60, 2 * h + 14 + 18 * r, runs[r].name + " (" + std::to_string(runs[r].step.size()) + " steps)",
                   Canvas::Anchor::Start, 12, kColours[r % 6]);
    }
    canvas->save(out);
    std::cout << "dtrain-plot: wrote " << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "dtrain-plot: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
