#pragma once
// Who may open the POSIX shared-memory objects a client creates for verifyd (shm regions, call
// channels). A client creates them 0600; a verifyd that runs as another user (the systemd unit
// and the DaemonSet do, with the serving stack's user in verifyd's group) could not open them. So
// a client gives each object to the group of verifyd's data socket, read-write (0660), when that
// socket admits its group and the client is in it: the same users may then open the object as
// may call verifyd. verifyd still maps an object only for the uid that owns it (SO_PEERCRED,
// src/region/shm_mapping.cc), so another member of the group cannot have verifyd read or write
// it.

#include <sys/stat.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <string_view>

namespace verifyd {

// The group that may call verifyd at `target`: for "unix:PATH" or "unix://PATH" (gRPC's forms;
// grpc::ClientContext::peer() names a Unix socket peer the first way) the socket's group when the
// socket is group-writable; nullopt for anything else (TCP, an abstract socket, a socket only its
// owner may use, a path this process cannot stat).
inline std::optional<gid_t> SocketGroup(std::string_view target) {
  std::string path;
  if (target.starts_with("unix://")) {
    path = target.substr(7);
  } else if (target.starts_with("unix:")) {
    path = target.substr(5);
  } else {
    return std::nullopt;
  }
  struct stat st {};
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) ||
      (st.st_mode & S_IWGRP) == 0) {
    return std::nullopt;
  }
  return st.st_gid;
}

// Gives the object open at `fd` to `group`, read-write for it (0660). False, with the object left
// as it was, when this process may not: it is not in that group (nor root).
inline bool ShareWithGroup(int fd, gid_t group) {
  if (::fchown(fd, static_cast<uid_t>(-1), group) != 0) return false;
  // fchmod, not shm_open's mode argument: the umask would take the group's bits away.
  return ::fchmod(fd, 0660) == 0;
}

}  // namespace verifyd
