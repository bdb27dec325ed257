#pragma once
// Early-return helpers for absl::Status / absl::StatusOr.

#define VERIFYD_CONCAT_INNER(a, b) a##b
#define VERIFYD_CONCAT(a, b) VERIFYD_CONCAT_INNER(a, b)

#define VERIFYD_RETURN_IF_ERROR(expr)                     \
  do {                                                    \
    if (absl::Status _st = (expr); !_st.ok()) return _st; \
  } while (0)

#define VERIFYD_ASSIGN_OR_RETURN(lhs, expr) \
  VERIFYD_ASSIGN_OR_RETURN_IMPL(VERIFYD_CONCAT(_status_or_, __LINE__), lhs, expr)
#define VERIFYD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(*tmp)
