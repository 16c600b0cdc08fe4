// dtrain-plot: an SVG with a loss and a tokens/s line per metrics file; clear errors.
#include <gtest/gtest.h>

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
}  // namespace

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
