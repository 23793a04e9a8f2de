// fp16/bf16 <-> fp32 conversion (common/dtype.h) against references computed in double
// arithmetic: exhaustive over the 65536 half patterns, random and tie-point floats the
// other way.
#include "common/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace conveyor {
namespace {

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Value of a binary16 pattern, straight from the IEEE definition.
double ref_fp16_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const double mag = exp == 0 ? std::ldexp(double(mant), -24) : std::ldexp(double(1024 + mant), exp - 25);
  return sign ? -mag : mag;
}

// Nearest binary16 (ties to even) to a finite float, for a format with `mant_bits`
// explicit mantissa bits and minimum normal exponent `min_exp`: find the value's binade,
// divide by the spacing there (exact: a power of two), round in double, re-encode.
uint16_t ref_round(float f, int mant_bits, int min_exp, int bias, double overflow_at, uint16_t inf_bits) {
  const uint16_t sign = std::signbit(f) ? uint16_t(1u << 15) : 0;
  const double a = std::fabs(double(f));
  if (a >= overflow_at) return sign | inf_bits;
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): a's binade is 2^(e-1)
  const int binade = std::max(e - 1, min_exp);  // subnormals share the lowest binade's spacing
  const double steps = std::nearbyint(a / std::ldexp(1.0, binade - mant_bits));  // ties to even
  if (e - 1 < min_exp) return sign | uint16_t(steps);  // subnormal (or rounds up to min normal)
  const uint32_t implicit = 1u << mant_bits;           // steps in [implicit, 2*implicit]
  return sign | uint16_t((uint32_t(binade + bias) << mant_bits) + (uint32_t(steps) - implicit));
}

uint16_t ref_float_to_fp16(float f) {
  return ref_round(f, 10, -14, 15, 65520.0, 0x7c00);  // 65520: halfway from 65504 to 2^16
}
uint16_t ref_float_to_bf16(float f) {
  return ref_round(f, 7, -126, 127, std::ldexp(2.0 - std::ldexp(1.0, -8), 127), 0x7f80);
}

// Random floats: uniform bit patterns (every exponent), the fp16 exponent range and float
// subnormals, and every kind of rounding tie: midpoints between neighbouring target values
// (exact in float) and the floats just either side of them. `decode` is the target's
// decoder (checked exhaustively on its own), `inf_bits` its +infinity pattern.
std::vector<float> test_floats(float (*decode)(uint16_t), uint16_t inf_bits) {
  std::mt19937 rng(12345);
  std::vector<float> out;
  auto push = [&](float f) {
    if (!std::isnan(f)) out.push_back(f);
  };
  for (int i = 0; i < 2'000'000; ++i) push(float_of(rng()));
  for (int i = 0; i < 1'000'000; ++i) {  // exponents 2^-27 .. 2^17: fp16 normals, subnormals, overflow
    const uint32_t exp = 100 + rng() % 45;
    push(float_of((rng() & 0x807fffffu) | (exp << 23)));
  }
  for (int i = 0; i < 200'000; ++i) push(float_of(rng() & 0x807fffffu));  // float subnormals
  for (int i = 0; i < 700'000; ++i) {
    const uint16_t h = uint16_t(rng() & 0x7fffu);
    if (h + 1 >= inf_bits) continue;
    const float mid = float((double(decode(h)) + double(decode(uint16_t(h + 1)))) / 2);
    for (float m : {mid, -mid}) {
      push(m);
      push(std::nextafter(m, 0.f));
      push(std::nextafter(m, m * 2));
    }
  }
  return out;
}

TEST(Fp16, DecodeMatchesIeeeDefinitionForAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_float(uint16_t(h));
    const int exp = (h >> 10) & 0x1f;
    if (exp == 0x1f) {
      if (h & 0x3ff) EXPECT_TRUE(std::isnan(f)) << h;
      else EXPECT_EQ(f, (h & 0x8000) ? -INFINITY : INFINITY) << h;
      continue;
    }
    ASSERT_EQ(double(f), ref_fp16_value(uint16_t(h))) << "pattern 0x" << std::hex << h;
    ASSERT_EQ(std::signbit(f), bool(h & 0x8000)) << h;  // -0 stays -0
  }
}

TEST(Fp16, RoundTripsEveryNonNanPattern) {
  int nan_count = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_float(uint16_t(h));
    if (std::isnan(f)) {
      ++nan_count;
      EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(f)))) << h;
      continue;
    }
    ASSERT_EQ(float_to_fp16(f), h) << "pattern 0x" << std::hex << h;
  }
  EXPECT_EQ(nan_count, 2 * 1023);
}

TEST(Fp16, EncodeRoundsToNearestEvenLikeDoubleReference) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  const auto floats = test_floats(fp16_to_float, 0x7c00);
  ASSERT_GT(floats.size(), 5'000'000u);
  size_t mismatches = 0;
  for (float f : floats) {
    const uint16_t got = float_to_fp16(f), want = ref_float_to_fp16(f);
    if (got != want && ++mismatches <= 10)
      ADD_FAILURE() << "float " << f << " (0x" << std::hex << bits_of(f) << "): got 0x" << got << ", want 0x" << want;
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(Fp16, SpecialValues) {
  EXPECT_EQ(float_to_fp16(65504.f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65519.996f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65520.f), 0x7c00);  // tie to even goes up to infinity
  EXPECT_EQ(float_to_fp16(INFINITY), 0x7c00);
  EXPECT_EQ(float_to_fp16(-INFINITY), 0xfc00);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_fp16(std::ldexp(1.f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(float_to_fp16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(float_to_fp16(-0.f), 0x8000);
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(NAN))));
}

TEST(Bf16, RoundTripsEveryNonNanPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_float(uint16_t(h));
    ASSERT_EQ(bits_of(f), h << 16);  // bf16 is the top half of a float
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f)))) << h;
      continue;
    }
    ASSERT_EQ(float_to_bf16(f), h) << "pattern 0x" << std::hex << h;
  }
}

TEST(Bf16, EncodeRoundsToNearestEvenLikeDoubleReference) {
  const auto floats = test_floats(bf16_to_float, 0x7f80);
  size_t mismatches = 0;
  for (float f : floats) {
    const uint16_t got = float_to_bf16(f), want = ref_float_to_bf16(f);
    if (got != want && ++mismatches <= 10)
      ADD_FAILURE() << "float " << f << " (0x" << std::hex << bits_of(f) << "): got 0x" << got << ", want 0x" << want;
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(Bf16, NanStaysNanAndOverflowGoesToInfinity) {
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(float_of(0x7f800001u)))));  // signalling, low payload
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80);
}

TEST(DType, NamesAndSizes) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::I8, DType::I32, DType::I64}) {
    auto back = dtype_from_name(dtype_name(t));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(dtype_bytes(DType::F32), 4u);
  EXPECT_EQ(dtype_bytes(DType::BF16), 2u);
  EXPECT_EQ(dtype_bytes(DType::I64), 8u);
  EXPECT_FALSE(dtype_from_name("F64").has_value());
  EXPECT_FALSE(dtype_from_name("f32").has_value());  // safetensors spelling is upper case
}

}  // namespace
}  // namespace conveyor
