#include "dtrain/comm/flight_recorder.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <new>
#include <sstream>

namespace dtrain::comm::flight {

namespace {

constexpr char kMagic[8] = "DTRNFR1";
constexpr size_t kBytes = sizeof(Header) + kCapacity * sizeof(Entry);

// The process's ring (Design note [flight recorder]): one per process, as PyTorch's flight
// recorder, created on first use and kept until exit (a collective may run during static
// destruction).
struct Ring {
  std::mutex mu;
  Header* header = nullptr;
  Entry* entries = nullptr;
  std::vector<char> memory;  // when there is no file to map
};

Ring& ring() {
  static Ring* r = [] {
    auto* ring = new Ring;
    void* mem = nullptr;
    const char* dir = std::getenv("DTRAIN_FLIGHT_DIR");
    const char* rank = std::getenv("RANK");
    if (dir && *dir && rank && *rank) {
      const std::string path = file_for(dir, std::atoi(rank));
      const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd >= 0) {
        if (::ftruncate(fd, static_cast<off_t>(kBytes)) == 0) {
          mem = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          if (mem == MAP_FAILED) mem = nullptr;
        }
        ::close(fd);
      }
    }
    if (!mem) {
      ring->memory.assign(kBytes, 0);
      mem = ring->memory.data();
    }
    ring->header = new (mem) Header();
    ring->entries = reinterpret_cast<Entry*>(static_cast<char*>(mem) + sizeof(Header));
    for (uint32_t i = 0; i < kCapacity; ++i) new (&ring->entries[i]) Entry();
    ring->header->capacity = kCapacity;
    ring->header->rank = rank ? std::atoi(rank) : 0;
    ring->header->pid = static_cast<int32_t>(::getpid());
    std::memcpy(ring->header->magic, kMagic, sizeof(kMagic));  // last: the file is now valid
    return ring;
  }();
  return *r;
}

void copy_text(char* dst, size_t size, const std::string& s) {
  const size_t n = std::min(size - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

Snapshot snapshot_of(const Header& h, const Entry* entries) {
  Snapshot s;
  s.rank = h.rank;
  s.pid = h.pid;
  s.events = h.events;
  s.step = h.step;
  const uint64_t written = h.written, cap = h.capacity;
  const uint64_t first = written > cap ? written - cap : 0;
  for (uint64_t i = first; i < written; ++i) {
    const Entry& e = entries[i % cap];
    if (e.state != static_cast<uint32_t>(OpState::Empty)) s.entries.push_back(e);
  }
  for (auto& e : s.entries) {  // (a reader may catch one mid-write: keep the text terminated)
    e.group[sizeof(e.group) - 1] = '\0';
    e.what[sizeof(e.what) - 1] = '\0';
  }
  return s;
}

}  // namespace

double now_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

std::string file_for(const std::string& dir, int rank) { return dir + "/rank-" + std::to_string(rank) + ".fr"; }

uint64_t start(const std::string& group, uint64_t seq, const std::string& what) {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mu);
  const uint64_t index = r.header->written;
  Entry& e = r.entries[index % kCapacity];
  e.state = static_cast<uint32_t>(OpState::Empty);
  e.seq = seq;
  e.start_s = now_seconds();
  e.end_s = 0;
  copy_text(e.group, sizeof(e.group), group);
  copy_text(e.what, sizeof(e.what), what);
  e.state = static_cast<uint32_t>(OpState::Started);
  r.header->written = index + 1;
  ++r.header->events;
  return index;
}

void end(uint64_t handle, bool ok) {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mu);
  if (handle + kCapacity < r.header->written) return;  // overwritten since
  Entry& e = r.entries[handle % kCapacity];
  e.end_s = now_seconds();
  e.state = static_cast<uint32_t>(ok ? OpState::Completed : OpState::Failed);
  ++r.header->events;
}

void note_step(int64_t step) {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mu);
  r.header->step = step;
}

Snapshot snapshot() {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mu);
  return snapshot_of(*r.header, r.entries);
}

namespace {
// The first `bytes` of a recorder file, with its header checked; false if absent or not one.
bool read_prefix(const std::string& path, size_t bytes, std::vector<char>& buf, Header& h) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  buf.resize(bytes);
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::pread(fd, buf.data() + got, bytes - got, static_cast<off_t>(got));
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got != bytes) return false;
  std::memcpy(&h, buf.data(), sizeof(Header));
  return std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 && h.capacity == kCapacity;
}
}  // namespace

std::optional<uint64_t> read_events(const std::string& path) {
  std::vector<char> buf;
  Header h;
  if (!read_prefix(path, sizeof(Header), buf, h)) return std::nullopt;
  return h.events;
}

std::optional<Snapshot> read_file(const std::string& path) {
  std::vector<char> buf;
  Header h;
  if (!read_prefix(path, kBytes, buf, h)) return std::nullopt;
  std::vector<Entry> entries(kCapacity);
  std::memcpy(static_cast<void*>(entries.data()), buf.data() + sizeof(Header), kCapacity * sizeof(Entry));
  return snapshot_of(h, entries.data());
}

std::string describe(const Snapshot& s, size_t n, double now_s) {
  if (now_s < 0) now_s = now_seconds();
  std::ostringstream os;
  const size_t first = s.entries.size() > n ? s.entries.size() - n : 0;
  char buf[64];
  for (size_t i = first; i < s.entries.size(); ++i) {
    const Entry& e = s.entries[i];
    os << "    " << e.what << " in group " << e.group << " #" << e.seq << ": ";
    switch (static_cast<OpState>(e.state)) {
      case OpState::Started:
        std::snprintf(buf, sizeof(buf), "in flight for %.1f s", now_s - e.start_s);
        break;
      case OpState::Completed:
        std::snprintf(buf, sizeof(buf), "completed %.1f s ago (took %.3f s)", now_s - e.end_s, e.end_s - e.start_s);
        break;
      case OpState::Failed:
        std::snprintf(buf, sizeof(buf), "failed %.1f s ago", now_s - e.end_s);
        break;
      default:
        std::snprintf(buf, sizeof(buf), "?");
    }
    os << buf << "\n";
  }
  return os.str();
}

}  // namespace dtrain::comm::flight
