// Reads from files with pread on C++ threads: no Python, and so no GIL, between a read's start
// and the wait for it. Python's pread workers need the GIL the decoder holds while it encodes a
// step, so their reads stalled until the host waited (2-4 ms a token of Engram reads on the H100,
// benchmarks/results/2026-12-05-174731-engram-reads.md for the mechanism).
//
//   start_rows    a file table's rows (dsv4/engram_store.py): segments of a row over a file that
//                 may be split into parts, read-ahead hints, the NaN checks of the Python path
//   start_ranges  byte ranges of files (dsv4/expert_store.py's expert pieces), dropped from the
//                 OS cache once read if asked
//   engram_rows   EngramRows, an MLX primitive reading a step's rows once their ids (hashed on
//                 the device) are ready, so a decoder can queue a whole step before its token is
//                 known (dsv4/engram_queued.py): on a CPU stream, or on CUDA as a host function in
//                 the step's own stream (reads_cuda.h, built with -DDSV4_CUDA)
//
// A read's status is (0, 0, 0), or (what, index of the row or range, errno) of the first that
// failed: what 1 an I/O error, 2 a short read (a truncated file), 3 a NaN or infinite value. A
// read never throws: the caller names the row from the status (the device never waits on a task
// that died).

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#ifdef DSV4_CUDA
#include <dlfcn.h>

#include <cuda.h>

#include "mlx/backend/cuda/device.h"
#endif
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

enum Status : int64_t { kRead = 0, kIoError = 1, kShortRead = 2, kNotFinite = 3 };
enum Check : int { kFp8 = 0, kBf16 = 1, kF32 = 2 };

// One part of a file that may be split into parts: its descriptor and where it starts in the
// whole.
struct Part {
  int fd;
  int64_t start;
  int64_t size;
};

// `width` bytes of row r at `offset + stride * r` of a (parted) file, stored at `dest` in the row.
struct Segment {
  std::vector<Part> parts;
  int64_t offset, stride, width, dest;
};

struct Failure {
  int64_t what = kRead, index = 0, error = 0;
};

// Reads `length` bytes at `offset` of the whole file into dst; the failure, if any.
Failure read_span(const Segment& seg, uint8_t* dst, int64_t offset, int64_t length) {
  for (const Part& part : seg.parts) {
    if (length == 0) break;
    int64_t inner = offset - part.start;
    if (inner < 0 || inner >= part.size) continue;
    int64_t n = std::min(length, part.size - inner);
    int64_t done = 0;
    while (done < n) {
      ssize_t got = ::pread(part.fd, dst + done, n - done, inner + done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return {kIoError, 0, errno};
      if (got == 0) return {kShortRead, 0, 0};
      done += got;
    }
    dst += n;
    offset += n;
    length -= n;
  }
  return length ? Failure{kShortRead, 0, 0} : Failure{};
}

enum Advice { kWillNeed, kDontNeed };

// Tells the OS about `length` bytes at `offset` of the whole file: read them ahead (WILLNEED), or
// drop them from its cache (DONTNEED; Linux: macOS keeps such files out of it with F_NOCACHE).
void advise(const Segment& seg, int64_t offset, int64_t length, Advice advice) {
  for (const Part& part : seg.parts) {
    int64_t inner = offset - part.start;
    if (length == 0 || inner < 0 || inner >= part.size) continue;
    int64_t n = std::min(length, part.size - inner);
#if defined(__APPLE__)
    if (advice == kWillNeed) {
      radvisory ahead{static_cast<off_t>(inner), static_cast<int>(n)};
      fcntl(part.fd, F_RDADVISE, &ahead);
    }
#elif defined(POSIX_FADV_WILLNEED)
    posix_fadvise(part.fd, inner, n, advice == kWillNeed ? POSIX_FADV_WILLNEED : POSIX_FADV_DONTNEED);
#endif
    offset += n;
    length -= n;
  }
}

// Whether a row holds a NaN (fp8: e4m3 0x7F/0xFF, e8m0 0xFF) or a float NaN or infinity.
bool finite(const uint8_t* row, int check, int64_t width) {
  if (check == kFp8) {
    for (int64_t j = 0; j < width; ++j)
      if ((row[j] & 0x7F) == 0x7F) return false;
    for (int64_t j = width; j < width + width / 32; ++j)
      if (row[j] == 0xFF) return false;
    return true;
  }
  if (check == kBf16) {
    for (int64_t j = 0; j < width; ++j) {
      uint16_t v;
      std::memcpy(&v, row + 2 * j, 2);
      if ((v & 0x7F80) == 0x7F80) return false;
    }
    return true;
  }
  for (int64_t j = 0; j < width; ++j) {
    uint32_t v;
    std::memcpy(&v, row + 4 * j, 4);
    if ((v & 0x7F800000u) == 0x7F800000u) return false;
  }
  return true;
}

// The threads that read: partitions of a call past its first (which its caller reads), and the
// host path's calls themselves. A thread is added whenever a task would find none idle, so a call
// running on one of them never waits for a partition no thread is free to take.
class Workers {
 public:
  static Workers& shared() {
    static Workers* pool = new Workers();  // never destroyed: threads outlive static teardown
    return *pool;
  }

  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
      if (idle_ < static_cast<int>(queue_.size())) {
        ++idle_;  // counted idle until it takes its first task
        std::thread([this] { loop(); }).detach();
      }
    }
    cv_.notify_one();
  }

  // Runs job(0..parts-1), job(0) on the calling thread, and returns when all are done.
  void run(int parts, const std::function<void(int)>& job) {
    std::mutex done_mutex;
    std::condition_variable done_cv;
    int left = parts - 1;
    for (int k = 1; k < parts; ++k)
      submit([&, k] {
        job(k);
        std::lock_guard<std::mutex> done_lock(done_mutex);
        if (--left == 0) done_cv.notify_one();
      });
    job(0);
    std::unique_lock<std::mutex> done_lock(done_mutex);
    done_cv.wait(done_lock, [&] { return left == 0; });
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
        --idle_;
      }
      task();
      std::lock_guard<std::mutex> lock(mutex_);
      ++idle_;
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  int idle_ = 0;
};

// Reads items 0..n-1 over `parts` partitions on the workers: prelude(lo, hi) first (read-ahead
// hints), then item(i) in order until one fails. The first failure in call order goes to state
// (zeros when none did): partitions run in call order, so the first failed one holds it.
template <class Prelude, class Item>
void read_partitioned(int64_t n, int workers, int64_t* state, Prelude prelude, Item item) {
  state[0] = state[1] = state[2] = 0;
  if (n == 0) return;
  int parts = static_cast<int>(std::min<int64_t>(std::max(1, workers), n));
  std::vector<Failure> failures(parts);
  Workers::shared().run(parts, [&](int k) {
    int64_t lo = n * k / parts, hi = n * (k + 1) / parts;
    prelude(lo, hi);
    for (int64_t i = lo; i < hi; ++i) {
      Failure f = item(i);
      if (f.what != kRead) {
        failures[k] = {f.what, i, f.error};
        return;
      }
    }
  });
  for (const Failure& f : failures)
    if (f.what != kRead) {
      state[0] = f.what;
      state[1] = f.index;
      state[2] = f.error;
      break;
    }
}

// The parts of a file from `from` on in a flat list: (fd, start in the whole, size) each.
std::vector<Part> parse_parts(const std::vector<int64_t>& flat, size_t from) {
  std::vector<Part> parts;
  for (size_t p = from; p + 2 < flat.size(); p += 3) parts.push_back({static_cast<int>(flat[p]), flat[p + 1], flat[p + 2]});
  return parts;
}

// What a call reads: shared with the queued task, which may outlive the primitive.
struct Table {
  std::vector<Segment> segments;
  int64_t row_bytes;
  int check;
  int64_t width;
  int workers;
  bool readahead;

  void read(const int64_t* ids, int64_t n, uint8_t* out, int64_t* state) const {
    read_partitioned(
        n, workers, state,
        [&](int64_t lo, int64_t hi) {
          if (readahead && hi - lo > 1)  // every page read in flight before the first pread waits
            for (int64_t i = lo; i < hi; ++i)
              for (const Segment& seg : segments) advise(seg, seg.offset + seg.stride * ids[i], seg.width, kWillNeed);
        },
        [&](int64_t i) {
          uint8_t* row = out + i * row_bytes;
          for (const Segment& seg : segments) {
            Failure f = read_span(seg, row + seg.dest, seg.offset + seg.stride * ids[i], seg.width);
            if (f.what != kRead) return f;
          }
          return finite(row, check, width) ? Failure{} : Failure{kNotFinite, 0, 0};
        });
  }

  bool operator==(const Table& o) const {
    if (row_bytes != o.row_bytes || check != o.check || width != o.width || segments.size() != o.segments.size())
      return false;
    for (size_t s = 0; s < segments.size(); ++s) {
      const Segment &a = segments[s], &b = o.segments[s];
      if (a.offset != b.offset || a.stride != b.stride || a.width != b.width || a.dest != b.dest ||
          a.parts.size() != b.parts.size())
        return false;
      for (size_t p = 0; p < a.parts.size(); ++p)
        if (a.parts[p].fd != b.parts[p].fd || a.parts[p].start != b.parts[p].start) return false;
    }
    return true;
  }
};

#ifdef DSV4_CUDA
#include "reads_cuda.h"
#endif

class EngramRows : public mx::Primitive {
 public:
  EngramRows(mx::Stream stream, std::shared_ptr<const Table> table)
      : mx::Primitive(stream), table_(std::move(table)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& ids = inputs[0];
    mx::array& rows = outputs[0];
    mx::array& status = outputs[1];
    rows.set_data(mx::allocator::malloc(rows.nbytes()));
    status.set_data(mx::allocator::malloc(status.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(ids);
    encoder.set_output_array(rows);
    encoder.set_output_array(status);
    // The pointers are taken in the task, after the stream waited for the ids: on CUDA the ids
    // may be in device memory, which data() moves to unified memory, and must be final then.
    encoder.dispatch([table = table_, ids = mx::array::unsafe_weak_copy(ids),
                      rows = mx::array::unsafe_weak_copy(rows), status = mx::array::unsafe_weak_copy(status)]() mutable {
      table->read(ids.data<int64_t>(), static_cast<int64_t>(ids.size()), rows.data<uint8_t>(),
                  status.data<int64_t>());
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
#ifdef DSV4_CUDA
    cuda_reads::eval(table_, stream(), inputs[0], outputs[0], outputs[1]);
#else
    throw std::runtime_error("[EngramRows] this build has no CUDA part: it runs on CPU streams only");
#endif
  }

  const char* name() const override { return "EngramRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return *table_ == *static_cast<const EngramRows&>(other).table_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {mx::Shape{inputs[0].shape(0), static_cast<int>(table_->row_bytes)}, mx::Shape{3}};
  }

 private:
  std::shared_ptr<const Table> table_;
};

// segments: per region of the row [offset, stride, width, dest, fd, start, size, fd, start,
// size, ...] (one fd/start/size triple per part of the file).
std::shared_ptr<const Table> make_table(const std::vector<std::vector<int64_t>>& segments, int64_t row_bytes,
                                        int check, int64_t width, int workers, bool readahead) {
  if (check < kFp8 || check > kF32) throw std::invalid_argument("[engram_rows] unknown check");
  std::vector<Segment> parsed;
  for (const auto& s : segments) {
    if (s.size() < 7 || (s.size() - 4) % 3)
      throw std::invalid_argument("[engram_rows] a segment is [offset, stride, width, dest, (fd, start, size)+]");
    Segment seg{parse_parts(s, 4), s[0], s[1], s[2], s[3]};
    if (seg.dest < 0 || seg.width <= 0 || seg.dest + seg.width > row_bytes)
      throw std::invalid_argument("[engram_rows] a segment falls outside the row");
    parsed.push_back(std::move(seg));
  }
  return std::make_shared<const Table>(Table{std::move(parsed), row_bytes, check, width, std::max(1, workers), readahead});
}

std::vector<mx::array> engram_rows(const mx::array& ids, const std::vector<std::vector<int64_t>>& segments,
                                   int64_t row_bytes, int check, int64_t width, int workers,
                                   bool readahead, mx::Stream stream) {
  if (ids.ndim() != 1) throw std::invalid_argument("[engram_rows] ids must be 1-D");
  auto table = make_table(segments, row_bytes, check, width, workers, readahead);
  auto flat = mx::contiguous(mx::astype(ids, mx::int64, stream), false, stream);
  return mx::array::make_arrays({mx::Shape{ids.shape(0), static_cast<int>(row_bytes)}, mx::Shape{3}},
                                {mx::uint8, mx::int64}, std::make_shared<EngramRows>(stream, table), {flat});
}

// A host path's read (dsv4/engram_store.py's rows, dsv4/expert_store.py's byte ranges), run on
// the workers into numpy arrays with no Python (and so no GIL) until `wait`. It keeps the arrays
// alive, and dropping it waits too: the buffers are Python's.
class HostRead {
 public:
  using Work = std::function<void(int64_t* state)>;

  HostRead(std::vector<nb::ndarray<>> keep, Work work) : keep_(std::move(keep)), done_(std::make_shared<Done>()) {
    Workers::shared().submit([work = std::move(work), done = done_] {
      int64_t state[3] = {0, 0, 0};
      work(state);
      std::lock_guard<std::mutex> lock(done->mutex);
      std::copy(state, state + 3, done->state);
      done->finished = true;
      done->cv.notify_all();
    });
  }

  HostRead(const HostRead&) = delete;
  HostRead& operator=(const HostRead&) = delete;
  ~HostRead() { wait(); }

  // (0, 0, 0), or (what, index of the row or range, errno) of the first that failed, as
  // engram_rows's status.
  std::vector<int64_t> wait() const {
    std::unique_lock<std::mutex> lock(done_->mutex);
    done_->cv.wait(lock, [this] { return done_->finished; });
    return {done_->state[0], done_->state[1], done_->state[2]};
  }

  bool done() const {
    std::lock_guard<std::mutex> lock(done_->mutex);
    return done_->finished;
  }

 private:
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool finished = false;
    int64_t state[3] = {0, 0, 0};
  };
  std::vector<nb::ndarray<>> keep_;
  std::shared_ptr<Done> done_;
};

HostRead* start_rows(nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> ids,
                     nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig> out,
                     const std::vector<std::vector<int64_t>>& segments, int64_t row_bytes, int check,
                     int64_t width, int workers, bool readahead) {
  auto table = make_table(segments, row_bytes, check, width, workers, readahead);
  if (out.shape(0) != ids.shape(0) || static_cast<int64_t>(out.shape(1)) != row_bytes)
    throw std::invalid_argument("[start_rows] out must be [len(ids), row_bytes]");
  return new HostRead({nb::ndarray<>(ids), nb::ndarray<>(out)},
                      [table, ids = ids.data(), n = static_cast<int64_t>(ids.shape(0)), out = out.data()](int64_t* state) {
                        table->read(ids, n, out, state);
                      });
}

// Range i: len(outs[i]) bytes at ranges[i][0] of the file whose parts follow, [(fd, start,
// size)+], into outs[i]; with `drop`, each range leaves the OS cache once read.
HostRead* start_ranges(std::vector<nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>> outs,
                       const std::vector<std::vector<int64_t>>& ranges, bool drop, int workers) {
  if (outs.size() != ranges.size()) throw std::invalid_argument("[start_ranges] one out per range");
  auto jobs = std::make_shared<std::vector<std::pair<Segment, uint8_t*>>>();
  std::vector<nb::ndarray<>> keep;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto& r = ranges[i];
    if (r.size() < 4 || (r.size() - 1) % 3)
      throw std::invalid_argument("[start_ranges] a range is [offset, (fd, start, size)+]");
    jobs->emplace_back(Segment{parse_parts(r, 1), r[0], 0, static_cast<int64_t>(outs[i].shape(0)), 0}, outs[i].data());
    keep.emplace_back(outs[i]);
  }
  return new HostRead(std::move(keep), [jobs, drop, workers](int64_t* state) {
    read_partitioned(
        static_cast<int64_t>(jobs->size()), workers, state, [](int64_t, int64_t) {},
        [&](int64_t i) {
          const auto& [seg, out] = (*jobs)[i];
          Failure f = read_span(seg, out, seg.offset, seg.width);
          if (f.what == kRead && drop) advise(seg, seg.offset, seg.width, kDontNeed);
          return f;
        });
  });
}

}  // namespace

NB_MODULE(_reads, m) {
  m.def("engram_rows", &engram_rows, nb::arg("ids"), nb::arg("segments"), nb::arg("row_bytes"),
        nb::arg("check"), nb::arg("width"), nb::arg("workers"), nb::arg("readahead"), nb::arg("stream"),
        "Rows [n, row_bytes] uint8 and a status [3] int64 of the rows `ids` [n] of a file table, "
        "read with pread on `stream` (a CPU stream, or with gpu_reads a CUDA one) when the ids are ready.");
#ifdef DSV4_CUDA
  m.attr("gpu_reads") = true;
#else
  m.attr("gpu_reads") = false;
#endif
  nb::class_<HostRead>(m, "HostRead", "A read on the workers: wait() gives its status, done() whether it is there.")
      .def("wait", &HostRead::wait, nb::call_guard<nb::gil_scoped_release>())
      .def("done", &HostRead::done);
  m.def("start_rows", &start_rows, nb::arg("ids"), nb::arg("out"), nb::arg("segments"), nb::arg("row_bytes"),
        nb::arg("check"), nb::arg("width"), nb::arg("workers"), nb::arg("readahead"), nb::rv_policy::take_ownership,
        "Read the rows `ids` [n] int64 of a file table into `out` [n, row_bytes] uint8 on the workers.");
  m.def("start_ranges", &start_ranges, nb::arg("outs"), nb::arg("ranges"), nb::arg("drop"), nb::arg("workers"),
        nb::rv_policy::take_ownership,
        "Read byte ranges [offset, (fd, start, size)+] of parted files into `outs` (uint8, one each) "
        "on the workers; with `drop` each leaves the OS cache once read.");
}
