#pragma once
// Where the admin API listens unless told otherwise: one default for verifyd, verifyctl, run.sh
// and the deploy files.

namespace verifyd {

inline constexpr char kDefaultAdminAddress[] = "unix:/run/verifyd/admin.sock";

}  // namespace verifyd
