// TensorBoard event files: CRC-32C against its check value, the TFRecord framing and the Event
// messages read back, and what the library loop writes with --tensorboard.
#include "dtrain/train/tensorboard.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "dtrain/util/fs.h"
#include "testing/testing.h"

using dtrain::train::read_scalar_events;
using dtrain::train::TensorBoardWriter;

TEST(TensorBoard, Crc32cCheckValues) {
  EXPECT_EQ(dtrain::train::crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value (RFC 3720)
  EXPECT_EQ(dtrain::train::crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(dtrain::train::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
}

TEST(TensorBoard, ScalarsReadBackWithValidFraming) {
  const std::string dir = dtrain::testing::temp_dir() + "/tb/run1";
  std::string path;
  {
    TensorBoardWriter w(dir);
    path = w.path();
    w.add_scalar("train/loss", 2.5, 1);
    w.add_scalar("train/loss", 1.25, 2);
    w.add_scalar("train/lr", 1e-3, 2);
    w.add_scalar("big", 7.0, int64_t(1) << 40);
    w.flush();
  }
  EXPECT_NE(dtrain::util::fs::filename(path).find("events.out.tfevents."), std::string::npos) << path;
  std::string version;
  const auto events = read_scalar_events(path, &version);
  EXPECT_EQ(version, "brain.Event:2");
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].tag, "train/loss");
  EXPECT_EQ(events[0].step, 1);
  EXPECT_EQ(events[0].value, 2.5f);
  EXPECT_EQ(events[1].value, 1.25f);
  EXPECT_EQ(events[2].tag, "train/lr");
  EXPECT_FLOAT_EQ(events[2].value, 1e-3f);
  EXPECT_EQ(events[3].step, int64_t(1) << 40);
  EXPECT_GT(events[0].wall_time, 1.7e9);

  // One flipped byte in a record's data: its CRC no longer matches.
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-6, std::ios::end);
  f.put('\x55');
  f.close();
  try {
    read_scalar_events(path);
    ADD_FAILURE() << "expected a CRC error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("data CRC mismatch"), std::string::npos) << e.what();
  }
}

TEST(TensorBoard, TheLoopWritesEveryStep) {
  const std::string dir = dtrain::testing::temp_dir() + "/tb";
  auto res = dtrain::testing::run_command(dtrain::testing::bin("dtrun") + " --standalone --nproc-per-node 2 " +
                                              dtrain::testing::bin("dtrain-mlp") +
                                              " --strategy zero2 --steps 5 --threads 1 --clip-grad-norm 1 --tensorboard " +
                                              dir,
                                          60);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  const auto files = dtrain::util::fs::list_directory(dir);
  ASSERT_EQ(files.size(), 1u) << "rank 0 writes one file";
  const auto events = read_scalar_events(dtrain::util::fs::join(dir, files[0]));
  int loss = 0, lr = 0, norm = 0;
  for (const auto& e : events) {
    loss += e.tag == "train/loss";
    norm += e.tag == "train/grad_norm";
    if (e.tag == "train/lr") {
      ++lr;
      EXPECT_FLOAT_EQ(e.value, 1e-3f);
    }
  }
  EXPECT_EQ(loss, 5);
  EXPECT_EQ(lr, 5);
  EXPECT_EQ(norm, 5);
}
