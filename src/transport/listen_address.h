#pragma once
// Listen addresses as the flags spell them (HOST:PORT or unix:PATH), and the checks that keep a
// second verifyd from binding on top of a running one.

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace verifyd {

bool IsUnixAddress(const std::string& address);

// Makes PATH of a unix:PATH listener ready to bind. Creates the parent directory (0755) when it
// is missing. Removes only a stale socket: a socket nobody accepts on. Refuses (naming `flag`)
// when a live socket is there (another process serves it) or when PATH is not a socket.
absl::Status PrepareUnixSocketPath(const std::string& flag, const std::string& path);

// Fails (naming `flag`) when the TCP HOST:PORT cannot be bound now, e.g. "HOST:PORT is in use
// by another process". Port 0 always passes.
absl::Status CheckTcpAddressFree(const std::string& flag, const std::string& address);

// Why a listener could not bind, for the error message of a failed start: for the first TCP
// address that cannot be bound now, "HOST:PORT is in use by another process" or the system's
// reason; else a plain "could not bind ADDRESSES".
std::string BindFailure(const std::vector<std::string>& addresses);

}  // namespace verifyd
