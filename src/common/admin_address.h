#pragma once
// Where verifyd listens unless told otherwise: one default for verifyd, verifyctl, run.sh and the
// deploy files. Both are the systemd unit's Unix sockets: a data plane on TCP is an explicit
// --listen=HOST:PORT, never a default.

namespace verifyd {

inline constexpr char kDefaultDataAddress[] = "unix:/run/verifyd/verifyd.sock";
inline constexpr char kDefaultAdminAddress[] = "unix:/run/verifyd/admin.sock";

}  // namespace verifyd
