#include "src/region/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/region/sigbus_guard.h"

namespace verifyd {
namespace {

class ShmMapping final : public MappedRegion {
 public:
  ShmMapping(void* map, uint64_t map_bytes, uint64_t skip, uint64_t byte_size, int guard)
      : map_(map), map_bytes_(map_bytes), skip_(skip), byte_size_(byte_size), guard_(guard) {}
  ~ShmMapping() override {
    RunBeforeUnmap();
    UnguardMapping(guard_);
    munmap(map_, map_bytes_);
  }

  char* base() const override { return static_cast<char*>(map_) + skip_; }
  uint64_t byte_size() const override { return byte_size_; }
  int device() const override { return -1; }
  bool intact() const override { return !MappingBroken(guard_); }
  absl::Status ReadToHost(uint64_t offset, uint64_t bytes, void* dst) const override {
    std::memcpy(dst, base() + offset, bytes);
    return absl::OkStatus();
  }

 private:
  void* map_;
  uint64_t map_bytes_, skip_, byte_size_;
  int guard_;  // sigbus_guard.h: the client may shrink its object under the mapping
};

std::string Errno() { return std::strerror(errno); }

}  // namespace

absl::StatusOr<std::unique_ptr<MappedRegion>> MapShm(const std::string& key, uint64_t offset,
                                                     uint64_t byte_size,
                                                     std::optional<uint32_t> caller_uid) {
  if (key.size() < 2 || key[0] != '/' || key.find('/', 1) != std::string::npos ||
      key.size() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: '", key,
                     "' is not a POSIX shared-memory name ('/' then 1 to 254 characters, no "
                     "other '/')"));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string why = Errno();
    if (err == ENOENT) {
      // The client created it (or said it did): in a container, verifyd and the client see the
      // same objects only in one IPC namespace.
      return absl::NotFoundError(absl::StrCat(
          "key: no shared-memory object '", key,
          "' (not in the same IPC namespace as verifyd? Pods need hostIPC: true, containers "
          "--ipc=host, for shm regions and call channels)"));
    }
    std::string hint;
    if (err == EACCES) {
      // verifyd opens the object as its own user: a client of another user must let verifyd's
      // group in (transports.md, "A client as another user").
      struct stat st {};
      std::string owner;
      if (stat(("/dev/shm" + key).c_str(), &st) == 0) {
        char mode[16];
        std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
        owner = absl::StrCat("; the object is uid ", st.st_uid, "'s, group ", st.st_gid, ", mode ",
                             mode);
      }
      hint = absl::StrCat(
          " (verifyd runs as uid ", geteuid(), owner,
          ": a client of another user joins the data socket's group and gives the object to it, "
          "read-write, mode 0660; verifyctl and the Python client do so when the client is in "
          "that group)");
    }
    return absl::PermissionDeniedError(
        absl::StrCat("key: cannot open shared-memory object '", key, "' read-write: ", why, hint));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const std::string why = Errno();
    close(fd);
    return absl::InternalError(absl::StrCat("key: fstat of '", key, "': ", why));
  }
  if (caller_uid && *caller_uid != 0 && st.st_uid != *caller_uid) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "key: shared-memory object '", key, "' belongs to uid ", st.st_uid,
        ", not to the caller (uid ", *caller_uid, "): verifyd maps only the caller's own objects"));
  }
  const uint64_t object_bytes = static_cast<uint64_t>(st.st_size);
  if (offset > object_bytes || byte_size > object_bytes - offset) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("byte_size: offset ", offset, " + byte_size ",
                                                   byte_size, " is past the end of '", key, "' (",
                                                   object_bytes, " bytes)"));
  }
  // mmap's offset must be page-aligned: map from the page that holds `offset`.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t skip = offset % page;
  const uint64_t map_bytes = skip + byte_size;
  void* map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                   static_cast<off_t>(offset - skip));
  const std::string why = map == MAP_FAILED ? Errno() : "";
  close(fd);  // the mapping keeps the object
  if (map == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("key: mmap of '", key, "': ", why));
  }
  absl::StatusOr<int> guard = GuardMapping(map, map_bytes);
  if (!guard.ok()) {
    munmap(map, map_bytes);
    return guard.status();
  }
  return std::unique_ptr<MappedRegion>(new ShmMapping(map, map_bytes, skip, byte_size, *guard));
}

}  // namespace verifyd
