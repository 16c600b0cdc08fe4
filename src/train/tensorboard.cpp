#include "dtrain/train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>

#include <c10/util/Exception.h>

#include "dtrain/util/fs.h"

namespace dtrain::train {

namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// --- protobuf wire format: just what Event needs ------------------------------------------------
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire) { varint(out, (static_cast<uint64_t>(field) << 3) | wire); }
template <class T>
void fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little endian (x86, aarch64)
  out.append(b, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& s) {
  key(out, field, 2);
  varint(out, s.size());
  out += s;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string event(double wall_time, int64_t step, const std::string* file_version, const std::string* summary) {
  std::string e;
  key(e, 1, 1);
  fixed(e, wall_time);
  if (step != 0) {
    key(e, 2, 0);
    varint(e, static_cast<uint64_t>(step));
  }
  if (file_version) bytes_field(e, 3, *file_version);
  if (summary) bytes_field(e, 5, *summary);
  return e;
}

// --- reading back ---------------------------------------------------------------------------------
struct Cursor {
  const std::string& s;
  size_t pos;
  size_t end;
  bool done() const { return pos >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      TORCH_CHECK(pos < end, "event: truncated varint");
      const auto b = static_cast<uint8_t>(s[pos++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    TORCH_CHECK(false, "event: varint too long");
  }
  template <class T>
  T fixed() {
    TORCH_CHECK(pos + sizeof(T) <= end, "event: truncated fixed field");
    T v;
    std::memcpy(&v, s.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  Cursor sub() {
    const uint64_t n = varint();
    TORCH_CHECK(n <= end - pos, "event: length-delimited field past the end");
    Cursor c{s, pos, pos + n};
    pos += n;
    return c;
  }
  void skip(int wire) {
    if (wire == 0) varint();
    else if (wire == 1) fixed<uint64_t>();
    else if (wire == 5) fixed<uint32_t>();
    else if (wire == 2) sub();
    else TORCH_CHECK(false, "event: unsupported wire type ", wire);
  }
};

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto& t = crc_table();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  const int err = util::fs::create_directories(dir);
  TORCH_CHECK(err == 0, "--tensorboard ", dir, ": cannot create the directory: ", util::fs::error_text(err));
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  std::ostringstream name;
  static std::atomic<int> writers{0};  // several writers in one process and second get their own files
  name << "events.out.tfevents." << static_cast<int64_t>(now_seconds()) << "." << host << "." << ::getpid() << "."
       << writers++;
  path_ = util::fs::join(dir, name.str());
  out_.open(path_, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out_.is_open(), "--tensorboard: cannot write ", path_);
  const std::string version = "brain.Event:2";
  write_record(event(now_seconds(), 0, &version, nullptr));
  flush();
}

void TensorBoardWriter::write_record(const std::string& data) {
  const uint64_t n = data.size();
  std::string header;
  fixed(header, n);
  fixed(header, masked_crc32c(header.data(), 8));
  out_.write(header.data(), static_cast<std::streamsize>(header.size()));
  out_.write(data.data(), static_cast<std::streamsize>(data.size()));
  std::string footer;
  fixed(footer, masked_crc32c(data.data(), data.size()));
  out_.write(footer.data(), static_cast<std::streamsize>(footer.size()));
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  if (!enabled()) return;
  std::string v;
  bytes_field(v, 1, tag);
  key(v, 2, 5);
  fixed(v, static_cast<float>(value));
  std::string summary;
  bytes_field(summary, 1, v);
  write_record(event(now_seconds(), step, nullptr, &summary));
}

void TensorBoardWriter::flush() {
  if (!enabled()) return;
  out_.flush();
  TORCH_CHECK(out_.good(), "--tensorboard: writing ", path_, " failed (disk full?)");
}

std::vector<ScalarEvent> read_scalar_events(const std::string& path, std::string* file_version) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open ", path);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<ScalarEvent> out;
  size_t pos = 0;
  for (int record = 0; pos < all.size(); ++record) {
    TORCH_CHECK(pos + 12 <= all.size(), path, ": record ", record, ": truncated header");
    uint64_t n;
    uint32_t crc;
    std::memcpy(&n, all.data() + pos, 8);
    std::memcpy(&crc, all.data() + pos + 8, 4);
    TORCH_CHECK(crc == masked_crc32c(all.data() + pos, 8), path, ": record ", record, ": length CRC mismatch");
    TORCH_CHECK(n <= all.size() - pos - 12 && all.size() - pos - 12 - n >= 4, path, ": record ", record,
                ": truncated data");
    std::memcpy(&crc, all.data() + pos + 12 + n, 4);
    TORCH_CHECK(crc == masked_crc32c(all.data() + pos + 12, n), path, ": record ", record, ": data CRC mismatch");
    Cursor e{all, pos + 12, pos + 12 + n};
    pos += 12 + n + 4;
    ScalarEvent ev;
    bool scalar = false;
    while (!e.done()) {
      const uint64_t k = e.varint();
      const int field = static_cast<int>(k >> 3), wire = static_cast<int>(k & 7);
      if (field == 1 && wire == 1) {
        ev.wall_time = e.fixed<double>();
      } else if (field == 2 && wire == 0) {
        ev.step = static_cast<int64_t>(e.varint());
      } else if (field == 3 && wire == 2) {
        Cursor c = e.sub();
        if (file_version) *file_version = all.substr(c.pos, c.end - c.pos);
      } else if (field == 5 && wire == 2) {
        Cursor summary = e.sub();
        while (!summary.done()) {
          const uint64_t sk = summary.varint();
          if ((sk >> 3) != 1 || (sk & 7) != 2) {
            summary.skip(static_cast<int>(sk & 7));
            continue;
          }
          Cursor value = summary.sub();
          while (!value.done()) {
            const uint64_t vk = value.varint();
            if ((vk >> 3) == 1 && (vk & 7) == 2) {
              Cursor t = value.sub();
              ev.tag = all.substr(t.pos, t.end - t.pos);
            } else if ((vk >> 3) == 2 && (vk & 7) == 5) {
              ev.value = value.fixed<float>();
              scalar = true;
            } else {
              value.skip(static_cast<int>(vk & 7));
            }
          }
        }
      } else {
        e.skip(wire);
      }
    }
    if (scalar) out.push_back(ev);
  }
  return out;
}

}  // namespace dtrain::train
