// dtrain-plot: an SVG or PNG with a loss and a tokens/s line per metrics file; clear errors.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "testing/testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;

namespace {
std::string write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}
std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
uint32_t be32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int k = 0; k < 4; ++k) v = (v << 8) | static_cast<unsigned char>(s[at + k]);
  return v;
}
uint32_t crc32(const std::string& s) {  // the PNG/zlib CRC, written bit by bit (independent of the tool's table)
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char ch : s) {
    c ^= ch;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}
struct Image {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
};
// Reads a PNG as dtrain-plot writes it (8-bit RGB, filter 0, stored deflate blocks), checking the
// signature, every chunk's CRC, the zlib header and the Adler-32 of the data.
Image read_png(const std::string& png) {
  Image img;
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::string z;
  bool ended = false;
  for (size_t at = 8; at + 12 <= png.size();) {
    const uint32_t len = be32(png, at);
    const std::string type = png.substr(at + 4, 4), data = png.substr(at + 8, len);
    EXPECT_EQ(be32(png, at + 8 + len), crc32(type + data)) << type << " chunk CRC";
    if (type == "IHDR") {
      img.width = be32(data, 0);
      img.height = be32(data, 4);
      EXPECT_EQ(data.substr(8), std::string("\x08\x02\x00\x00\x00", 5)) << "8-bit RGB, no interlace";
    } else if (type == "IDAT") {
      z += data;
    } else if (type == "IEND") {
      ended = true;
    }
    at += 12 + len;
  }
  EXPECT_TRUE(ended);
  EXPECT_EQ((static_cast<unsigned char>(z[0]) * 256 + static_cast<unsigned char>(z[1])) % 31, 0) << "zlib header check";
  std::string raw;
  size_t at = 2;
  for (bool last = false; !last && at + 5 <= z.size();) {
    last = z[at] & 1;
    EXPECT_EQ((z[at] >> 1) & 3, 0) << "stored block";
    const size_t n = static_cast<unsigned char>(z[at + 1]) | (static_cast<unsigned char>(z[at + 2]) << 8);
    const size_t nn = static_cast<unsigned char>(z[at + 3]) | (static_cast<unsigned char>(z[at + 4]) << 8);
    EXPECT_EQ(n ^ nn, 0xFFFFu);
    raw += z.substr(at + 5, n);
    at += 5 + n;
  }
  uint32_t a = 1, b = 0;
  for (unsigned char c : raw) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  EXPECT_EQ(be32(z, at), (b << 16) | a) << "Adler-32";
  const size_t row = img.width * 3 + 1;
  EXPECT_EQ(raw.size(), row * img.height);
  for (uint32_t j = 0; j < img.height && raw.size() == row * img.height; ++j) {
    EXPECT_EQ(raw[j * row], 0) << "row filter";
    img.rgb.insert(img.rgb.end(), raw.begin() + j * row + 1, raw.begin() + (j + 1) * row);
  }
  return img;
}
size_t count(const Image& img, std::array<uint8_t, 3> rgb) {
  size_t n = 0;
  for (size_t i = 0; i + 2 < img.rgb.size(); i += 3) n += img.rgb[i] == rgb[0] && img.rgb[i + 1] == rgb[1] && img.rgb[i + 2] == rgb[2];
  return n;
}
}  // namespace

TEST(Plot, PngByExtension) {
  const std::string dir = dtrain::testing::temp_dir();
  std::string a, b;
  for (int s = 1; s <= 20; ++s) {
    a += "{\"step\": " + std::to_string(s) + ", \"loss\": " + std::to_string(3.0 / s) + ", \"tokens_per_s\": 1000}\n";
  }
  write(dir + "/a.jsonl", a);
  write(dir + "/b.jsonl", "{\"step\": 1, \"loss\": 1.0, \"tokens_per_s\": 10}\n");
  auto res = run_command(bin("dtrain-plot") + " -o " + dir + "/out.png " + dir + "/a.jsonl", 30);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  Image one = read_png(slurp(dir + "/out.png"));
  EXPECT_EQ(one.width, 900u);
  EXPECT_EQ(one.height, 2u * 320 + 20 + 18);
  const size_t blue = count(one, {0x1f, 0x77, 0xb4}), red = count(one, {0xd6, 0x27, 0x28});
  EXPECT_GT(blue, 1500u) << "the first run's lines (loss over 20 steps, tokens/s flat) and its legend";
  EXPECT_EQ(red, 0u);
  EXPECT_GT(count(one, {0, 0, 0}), 500u) << "titles and tick labels";
  EXPECT_GT(count(one, {0x88, 0x88, 0x88}), 2000u) << "two panel frames";
  // A second run adds its own colour; the image grows by one legend line.
  res = run_command(bin("dtrain-plot") + " -o " + dir + "/two.png " + dir + "/a.jsonl " + dir + "/b.jsonl", 30);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  Image two = read_png(slurp(dir + "/two.png"));
  EXPECT_EQ(two.height, one.height + 18);
  EXPECT_GT(count(two, {0xd6, 0x27, 0x28}), 20u) << "the second run (one point per panel) and its legend";
}

TEST(Plot, OneLinePerRunAndPanel) {
  const std::string dir = dtrain::testing::temp_dir();
  std::string a, b;
  for (int s = 1; s <= 5; ++s) {
    a += "{\"step\": " + std::to_string(s) + ", \"loss\": " + std::to_string(3.0 / s) + ", \"tokens_per_s\": 1000}\n";
    b += "{\"step\": " + std::to_string(s) + ", \"loss\": " + std::to_string(2.0 / s) + ", \"tokens_per_s\": 2000}\n";
  }
  a += "{\"final\": true, \"param_checksum\": 1.5}\n";
  write(dir + "/a.jsonl", a);
  write(dir + "/b.jsonl", b.substr(0, b.rfind("{\"step\": 5")));  // 4 steps
  auto res = run_command(bin("dtrain-plot") + " -o " + dir + "/out.svg " + dir + "/a.jsonl " + dir + "/b.jsonl", 30);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  const std::string svg = slurp(dir + "/out.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  std::regex line("<polyline class=\"series\"[^>]*points=\"([^\"]*)\"");
  std::vector<int> points;
  for (std::sregex_iterator it(svg.begin(), svg.end(), line), end; it != end; ++it) {
    std::istringstream ps((*it)[1]);
    int n = 0;
    for (std::string p; ps >> p;) ++n;
    points.push_back(n);
  }
  EXPECT_EQ(points, (std::vector<int>{5, 4, 5, 4})) << "loss panel then tokens/s panel, one line per run";
  EXPECT_NE(svg.find("a.jsonl (5 steps)"), std::string::npos);
  // A diverged run (loss null) and a name that needs escaping still plot.
  write(dir + "/x&y.jsonl", "{\"step\": 1, \"loss\": 2.0, \"tokens_per_s\": 5}\n{\"step\": 2, \"loss\": null, \"tokens_per_s\": 5}\n");
  res = run_command(bin("dtrain-plot") + " -o " + dir + "/nan.svg '" + dir + "/x&y.jsonl'", 30);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  EXPECT_NE(slurp(dir + "/nan.svg").find("x&amp;y.jsonl (2 steps)"), std::string::npos);
}

TEST(Plot, ClearErrors) {
  const std::string dir = dtrain::testing::temp_dir();
  auto res = run_command(bin("dtrain-plot") + " " + dir + "/missing.jsonl", 30);
  EXPECT_EQ(res.exit_code, 1);
  EXPECT_NE(res.output.find("cannot open"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-plot") + " " + write(dir + "/bad.jsonl", "{\"step\": 1, \"loss\": \n"), 30);
  EXPECT_EQ(res.exit_code, 1);
  EXPECT_NE(res.output.find("bad.jsonl:1: not a JSON line"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-plot") + " " + write(dir + "/final.jsonl", "{\"final\": true}\n"), 30);
  EXPECT_EQ(res.exit_code, 1);
  EXPECT_NE(res.output.find("no step lines"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-plot"), 30);
  EXPECT_EQ(res.exit_code, 2);
}
