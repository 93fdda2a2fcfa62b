// The SSD tier's blocks of a large chunk written straight from the rows' own memory.
//
// A block is one Arrow IPC record batch message (codec.encode_block: RecordBatch.serialize).
// Serializing copies every byte of the rows into a new buffer, which the block's checksum
// then reads and writev copies again into the page cache: for 256 rows of 36 KiB (9.4 MB,
// 128 blocks) the serialize alone took 2.6 ms of the insert's 12 here. Arrow's IPC writer
// builds the same message from a payload (ipc::GetRecordBatchPayload) whose body buffers
// are the arrays' own buffers; this module has ipc::WriteIpcPayload write that payload into
// a sink that keeps references to the large buffers and copies only the small pieces (the
// message's metadata, padding, offsets and validity of short columns), computes each
// block's CRC32C over those pieces, and writes them all to a file with writev, the GIL
// released throughout. The bytes in the file are those of serialize(): tests compare them.
// Measured here on those rows: an insert into a durable table took 8.8-8.9 ms in process
// instead of 11.2-12.3, and the server's CPU per insert over gRPC 16 ms instead of 19-20.
//
// The checksums are computed as the blocks are written, a group of blocks of at most
// kGroupBytes at a time: the CRC reads a group into the CPU's cache and writev copies it
// from there, where checksumming all 9.4 MB first had the write read it from memory again.
// Measured on the rows above, in process: encode and write 5.1 ms instead of 5.4.
//
// encode(batches) -> Messages: sizes (bytes of each block), checksums (CRC32C of each:
// computed by write_to, or by this first read if it comes before), write_to(fd) (every
// byte, in order; raises OSError, goes on after short writes). None of it touches Python
// objects once built, so the rows' arrays must stay alive while it lives: it holds
// references to their buffers.
//
// Only where the CPU has the CRC32 instruction (SSE 4.2): elsewhere `supported()` is false
// and the SSD tier serializes in Python.

#include <arrow/api.h>
#include <arrow/io/interfaces.h>
#include <arrow/ipc/writer.h>
#include <arrow/python/pyarrow.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <poll.h>
#include <sys/uio.h>
#include <vector>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace py = pybind11;

namespace {

constexpr int64_t kReferenceBytes = 16384;  // buffers at least this long are written from where they are
constexpr int64_t kArenaBytes = 1 << 16;   // the small pieces are copied into arenas of this size
constexpr int64_t kGroupBytes = 512 << 10; // blocks checksummed, then written, together (in L2)

#if defined(__x86_64__)
// CRC32C on the CPU's instruction. One instruction's result feeds the next, with a latency
// of three cycles: three lanes of a stretch run side by side and are joined after (as the
// crc32c package and RocksDB do), which makes it ~3x faster than one lane.
constexpr uint32_t kPolynomial = 0x82f63b78;  // CRC32C, reflected
constexpr size_t kLane = 4096;                // bytes of each of the three lanes

// a * b modulo the polynomial, both reflected (zlib's multmodp)
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, product = 0;
  for (;;) {
    if (a & m) {
      product ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ kPolynomial : b >> 1;
  }
  return product;
}

// x^(8 * bytes) modulo the polynomial: what shifts a CRC past that many bytes
uint32_t ShiftFactor(size_t bytes) {
  uint32_t power = 1u << 30;  // x^1
  uint32_t result = 1u << 31;  // x^0
  for (uint64_t bits = 8ull * bytes; bits; bits >>= 1) {
    if (bits & 1) result = MultiplyModP(power, result);
    power = MultiplyModP(power, power);
  }
  return result;
}

const uint32_t kLaneShift = ShiftFactor(kLane);

__attribute__((target("sse4.2"))) uint64_t Lane(uint64_t c, const uint8_t* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

// The CRC32C of `crc`'s bytes followed by n bytes at p (crc: a finished CRC, 0 to start).
__attribute__((target("sse4.2"))) uint32_t Crc32c(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = static_cast<uint32_t>(~crc);
  for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
    uint64_t b = 0, d = 0;  // the register of lanes two and three, from zero: linear, shifted in after
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kLane + i, 8);
      std::memcpy(&w2, p + 2 * kLane + i, 8);
      c = _mm_crc32_u64(c, w0);
      b = _mm_crc32_u64(b, w1);
      d = _mm_crc32_u64(d, w2);
    }
    c = MultiplyModP(kLaneShift, MultiplyModP(kLaneShift, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(b)) ^
        static_cast<uint32_t>(d);
  }
  return ~static_cast<uint32_t>(Lane(c, p, n));
}

bool Supported() { return __builtin_cpu_supports("sse4.2"); }
#else
uint32_t Crc32c(uint32_t crc, const uint8_t*, size_t) { return crc; }
bool Supported() { return false; }
#endif

// An OutputStream that records what is written to it as pieces of memory, in order.
class PieceSink : public arrow::io::OutputStream {
 public:
  arrow::Status Close() override { closed_ = true; return arrow::Status::OK(); }
  bool closed() const override { return closed_; }
  arrow::Result<int64_t> Tell() const override { return position_; }

  arrow::Status Write(const void* data, int64_t nbytes) override {
    Copy(static_cast<const uint8_t*>(data), nbytes);
    return arrow::Status::OK();
  }

  arrow::Status Write(const std::shared_ptr<arrow::Buffer>& data) override {
    if (data->size() < kReferenceBytes || !data->is_cpu()) {
      Copy(data->data(), data->size());
    } else {
      held_.push_back(data);
      pieces_.push_back(iovec{const_cast<uint8_t*>(data->data()), static_cast<size_t>(data->size())});
      position_ += data->size();
    }
    return arrow::Status::OK();
  }

  // The pieces so far belong to one block: later copies start a piece of their own.
  void EndBlock() { sealed_ = pieces_.size(); }

  int64_t position() const { return position_; }
  const std::vector<iovec>& pieces() const { return pieces_; }
  size_t piece_count() const { return pieces_.size(); }

 private:
  // Appends to the last arena (a new one when full), extending the last piece when it
  // ends where the copy starts.
  void Copy(const uint8_t* data, int64_t nbytes) {
    if (nbytes <= 0) return;
    if (arenas_.empty() || arena_used_ + nbytes > arena_size_) {
      arena_size_ = std::max(kArenaBytes, nbytes);
      arenas_.push_back(std::make_unique_for_overwrite<uint8_t[]>(arena_size_));
      arena_used_ = 0;
    }
    uint8_t* at = arenas_.back().get() + arena_used_;
    std::memcpy(at, data, nbytes);
    arena_used_ += nbytes;
    position_ += nbytes;
    if (pieces_.size() > sealed_ && static_cast<uint8_t*>(pieces_.back().iov_base) + pieces_.back().iov_len == at) {
      pieces_.back().iov_len += nbytes;
    } else {
      pieces_.push_back(iovec{at, static_cast<size_t>(nbytes)});
    }
  }

  std::vector<std::unique_ptr<uint8_t[]>> arenas_;
  int64_t arena_size_ = 0, arena_used_ = 0;  // of the last arena
  std::vector<std::shared_ptr<arrow::Buffer>> held_;
  std::vector<iovec> pieces_;
  size_t sealed_ = 0;
  int64_t position_ = 0;
  bool closed_ = false;
};

class Messages {
 public:
  explicit Messages(std::vector<std::shared_ptr<arrow::RecordBatch>> batches) {
    const auto options = arrow::ipc::IpcWriteOptions::Defaults();
    first_piece_.push_back(0);
    for (const auto& batch : batches) {
      const int64_t start = sink_.position();
      arrow::ipc::IpcPayload payload;
      Check(arrow::ipc::GetRecordBatchPayload(*batch, options, &payload));
      int32_t metadata_length = 0;
      Check(arrow::ipc::WriteIpcPayload(payload, options, &sink_, &metadata_length));
      sink_.EndBlock();
      first_piece_.push_back(sink_.piece_count());
      sizes_.push_back(sink_.position() - start);
    }
    checksums_.resize(sizes_.size());
  }

  const std::vector<int64_t>& sizes() const { return sizes_; }

  const std::vector<uint32_t>& checksums() {
    if (!summed_) {
      py::gil_scoped_release release;
      Sum(0, sizes_.size());
      summed_ = true;
    }
    return checksums_;
  }

  // Every block, in order, a group at a time (checksummed first, unless already), going
  // on after short writes (and, on a descriptor that does not block, waiting for room);
  // on an error, errno as OSError.
  void WriteTo(int fd) {
    int error = 0;
    {
      py::gil_scoped_release release;
      for (size_t block = 0, end; block < sizes_.size() && !error; block = end) {
        int64_t bytes = sizes_[block];
        for (end = block + 1; end < sizes_.size() && bytes + sizes_[end] <= kGroupBytes; ++end) bytes += sizes_[end];
        if (!summed_) Sum(block, end);
        error = WritePieces(fd, first_piece_[block], first_piece_[end]);
      }
      summed_ = summed_ || !error;
    }
    if (error) {
      errno = error;
      PyErr_SetFromErrno(PyExc_OSError);
      throw py::error_already_set();
    }
  }

 private:
  static void Check(const arrow::Status& status) {
    if (!status.ok()) throw std::runtime_error("encoding a block: " + status.ToString());
  }

  // The checksums of blocks [begin, end).
  void Sum(size_t begin, size_t end) {
    const auto& pieces = sink_.pieces();
    for (size_t block = begin; block < end; ++block) {
      uint32_t crc = 0;
      for (size_t piece = first_piece_[block]; piece < first_piece_[block + 1]; ++piece) {
        crc = Crc32c(crc, static_cast<const uint8_t*>(pieces[piece].iov_base), pieces[piece].iov_len);
      }
      checksums_[block] = crc;
    }
  }

  // Writes pieces [begin, end); 0, or the errno of the write that failed.
  int WritePieces(int fd, size_t begin, size_t end) const {
    std::vector<iovec> rest(sink_.pieces().begin() + begin, sink_.pieces().begin() + end);
    size_t head = 0;
    while (head < rest.size()) {
      const int count = static_cast<int>(std::min<size_t>(rest.size() - head, IOV_MAX));
      const ssize_t written = ::writev(fd, rest.data() + head, count);
      if (written < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) {  // a descriptor that does not block (a pipe, a socket): wait for room
          pollfd ready{fd, POLLOUT, 0};
          if (::poll(&ready, 1, -1) >= 0 || errno == EINTR) continue;
        }
        return errno;
      }
      size_t left = static_cast<size_t>(written);
      while (head < rest.size() && left >= rest[head].iov_len) left -= rest[head++].iov_len;
      if (left) {
        rest[head].iov_base = static_cast<uint8_t*>(rest[head].iov_base) + left;
        rest[head].iov_len -= left;
      }
      while (head < rest.size() && rest[head].iov_len == 0) ++head;
    }
    return 0;
  }

  PieceSink sink_;
  std::vector<size_t> first_piece_;  // of each block, and one past the last
  std::vector<int64_t> sizes_;
  std::vector<uint32_t> checksums_;
  bool summed_ = false;  // every checksum computed
};

std::unique_ptr<Messages> Encode(const py::list& objects) {
  std::vector<std::shared_ptr<arrow::RecordBatch>> batches;
  batches.reserve(objects.size());
  for (const auto& obj : objects) {
    auto batch = arrow::py::unwrap_batch(obj.ptr());
    if (!batch.ok()) throw py::type_error("encode: batches must be pyarrow RecordBatches");
    batches.push_back(*batch);
  }
  py::gil_scoped_release release;
  return std::make_unique<Messages>(std::move(batches));
}

}  // namespace

PYBIND11_MODULE(_blocks_native, m) {
  if (arrow::py::import_pyarrow() != 0) throw py::error_already_set();
  m.def("supported", &Supported);
  m.def("encode", &Encode, py::arg("batches"));
  py::class_<Messages>(m, "Messages")
      .def_property_readonly("sizes", &Messages::sizes)
      .def_property_readonly("checksums", &Messages::checksums)
      .def("write_to", &Messages::WriteTo, py::arg("fd"));
}
