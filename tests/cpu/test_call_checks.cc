// The in-process op's input checks (kernels/call_checks.h), which its check kernel and the
// shipped kernel's own checks share, against the contract (kernels/op/verify_op_api.h): every
// rule's edge on both sides.

#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/call_checks.h"

namespace verifyd::kernels {
namespace {

// One request's layout; the defaults are sound: pages [4, 9) of a 12-entry kv_indices, 70 keys
// of at most 5 x 16, T 6, max_kv_len 100.
struct Layout {
  int b = 1;
  int64_t lo = 4, hi = 9, kv_len = 70, max_indices = 12, draft = 6, max_kv_len = 100;
  int64_t page_size = 16;
  bool Bad() const {
    return RequestLayoutBad(b, lo, hi, kv_len, max_indices, draft, max_kv_len, page_size);
  }
};

TEST(CallChecks, ARequestsLayoutIsRefusedPastEachBoundAndTakenAtIt) {
  EXPECT_FALSE(Layout{}.Bad());
  auto with = [](auto change) {
    Layout l;
    change(l);
    return l.Bad();
  };
  // kv_indptr: from 0, rising, within max_indices.
  EXPECT_TRUE(with([](Layout& l) { l.b = 0; }));  // request 0 starting at 4
  EXPECT_FALSE(with([](Layout& l) { l.b = 0, l.lo = 0, l.hi = 5; }));
  EXPECT_TRUE(with([](Layout& l) { l.hi = 3; }));  // falling
  EXPECT_FALSE(with([](Layout& l) { l.hi = 12, l.kv_len = 70; }));
  EXPECT_TRUE(with([](Layout& l) { l.hi = 13; }));  // past max_indices
  // kv_len in [T, min(max_kv_len, pages x page_size)].
  EXPECT_FALSE(with([](Layout& l) { l.kv_len = 6; }));
  EXPECT_TRUE(with([](Layout& l) { l.kv_len = 5; }));    // shorter than its draft
  EXPECT_FALSE(with([](Layout& l) { l.kv_len = 80; }));  // exactly its 5 pages
  EXPECT_TRUE(with([](Layout& l) { l.kv_len = 81; }));   // past its pages
  EXPECT_FALSE(with([](Layout& l) { l.hi = 12, l.kv_len = 100; }));
  EXPECT_TRUE(with([](Layout& l) { l.hi = 12, l.kv_len = 101; }));  // past max_kv_len
  EXPECT_TRUE(with([](Layout& l) { l.lo = 9, l.kv_len = 6; }));     // no page at all
  // Sizes past 32 bits are not wrapped.
  EXPECT_TRUE(with([](Layout& l) {
    l.hi = int64_t{1} << 33, l.max_indices = l.hi, l.max_kv_len = int64_t{1} << 40;
    l.kv_len = l.max_kv_len;  // past (2^33 - 4) x 16
  }));
}

TEST(CallChecks, APageIdIsInsideThePoolOrBad) {
  const uint32_t ten = PageIdLimit(10);
  EXPECT_TRUE(PageIdBad(-1, ten));
  EXPECT_FALSE(PageIdBad(0, ten));
  EXPECT_FALSE(PageIdBad(9, ten));
  EXPECT_TRUE(PageIdBad(10, ten));
  EXPECT_TRUE(PageIdBad(INT32_MIN, ten));
  // A pool past 2^31 pages holds every non-negative int32 id, and none of the negative ones.
  const uint32_t huge = PageIdLimit(int64_t{1} << 32);
  EXPECT_FALSE(PageIdBad(INT32_MAX, huge));
  EXPECT_TRUE(PageIdBad(-1, huge));
  EXPECT_TRUE(PageIdBad(INT32_MIN, huge));
  // No pages: every id is outside.
  EXPECT_TRUE(PageIdBad(0, PageIdLimit(0)));
  EXPECT_TRUE(PageIdBad(0, PageIdLimit(-5)));
}

TEST(CallChecks, AMaskByteIsZeroOrOneAndABitPackedRowSetsNoBitPastT) {
  // Bytes: 0 and 1 only, wherever in the row.
  EXPECT_FALSE(MaskByteBad(0, false, 7, false));
  EXPECT_FALSE(MaskByteBad(1, false, 7, true));
  EXPECT_TRUE(MaskByteBad(2, false, 7, false));
  EXPECT_TRUE(MaskByteBad(255, false, 8, true));
  // Bits, T = 7: the last byte's bit 7 is past T; the other bytes and a T of 8 hold any bits.
  EXPECT_FALSE(MaskByteBad(0x7f, true, 7, true));
  EXPECT_TRUE(MaskByteBad(0x80, true, 7, true));
  EXPECT_FALSE(MaskByteBad(0xff, true, 15, false));
  EXPECT_TRUE(MaskByteBad(0x80, true, 15, true));
  EXPECT_FALSE(MaskByteBad(0xff, true, 8, true));
  EXPECT_FALSE(MaskByteBad(0x01, true, 1, true));
  EXPECT_TRUE(MaskByteBad(0x02, true, 1, true));
}

TEST(CallChecks, APairOfBf16IsNonFiniteWhenEitherIsNaNOrInf) {
  EXPECT_FALSE(NonFiniteBf16Pair(0x3f80bf80u));  // 1 and -1
  EXPECT_FALSE(NonFiniteBf16Pair(0x7f7fff7fu));  // the largest finite magnitudes
  EXPECT_TRUE(NonFiniteBf16Pair(0x3f807f80u));   // +inf low
  EXPECT_TRUE(NonFiniteBf16Pair(0xff803f80u));   // -inf high
  EXPECT_TRUE(NonFiniteBf16Pair(0x00007fc0u));   // NaN low
  EXPECT_TRUE(NonFiniteBf16Pair(0xffc10000u));   // NaN high
}

}  // namespace
}  // namespace verifyd::kernels
