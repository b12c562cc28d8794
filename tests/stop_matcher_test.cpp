#include "text/stop_matcher.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using lily::text::StopMatcher;

struct Outcome {
  std::string text;  // everything emitted, flush included
  bool stopped = false;
  int matched = -1;
};

Outcome feed(const std::vector<std::string>& stops, const std::vector<std::string>& pieces) {
  StopMatcher m(stops);
  Outcome o;
  for (const auto& p : pieces) {
    auto r = m.push(p);
    o.text += r.emit;
    EXPECT_EQ(r.stopped, m.stopped());
    if (r.stopped) o.stopped = true;
  }
  o.text += m.flush();
  o.matched = m.matched_index();
  return o;
}

// The text before the stop string that completes first (longest on ties).
Outcome reference(const std::vector<std::string>& stops, const std::string& text) {
  for (size_t end = 1; end <= text.size(); ++end) {
    int best = -1;
    for (size_t i = 0; i < stops.size(); ++i) {
      const auto& s = stops[i];
      if (s.empty() || s.size() > end || text.compare(end - s.size(), s.size(), s) != 0) continue;
      if (best < 0 || s.size() > stops[best].size()) best = static_cast<int>(i);
    }
    if (best >= 0) return {text.substr(0, end - stops[best].size()), true, best};
  }
  return {text, false, -1};
}

void check_every_split(const std::vector<std::string>& stops, const std::string& text,
                       const std::string& expected, bool stopped) {
  const Outcome ref = reference(stops, text);
  ASSERT_EQ(ref.text, expected);
  ASSERT_EQ(ref.stopped, stopped);
  auto same = [&](const Outcome& o, const std::string& how) {
    EXPECT_EQ(o.text, ref.text) << how;
    EXPECT_EQ(o.stopped, ref.stopped) << how;
    EXPECT_EQ(o.matched, ref.matched) << how;
  };
  same(feed(stops, {text}), "whole");
  for (size_t cut = 0; cut <= text.size(); ++cut)
    same(feed(stops, {text.substr(0, cut), text.substr(cut)}), "cut " + std::to_string(cut));
  for (size_t a = 0; a <= text.size(); ++a)
    for (size_t b = a; b <= text.size(); ++b)
      same(feed(stops, {text.substr(0, a), text.substr(a, b - a), text.substr(b)}),
           "cuts " + std::to_string(a) + "," + std::to_string(b));
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  same(feed(stops, bytes), "bytes");
}

TEST(StopMatcher, SplitAtEveryPosition) {
  check_every_split({"STOP"}, "Hello world STOP more text", "Hello world ", true);
  check_every_split({"<|im_end|>"}, "a <|im_e b <|im_end|>c", "a <|im_e b ", true);
}

TEST(StopMatcher, MultipleStopStrings) {
  check_every_split({"END", "\n\n"}, "a\nb END c\n\nd", "a\nb ", true);
  check_every_split({"END", "\n\n"}, "a\nb\n\nEND", "a\nb", true);
  StopMatcher m({"x", "END"});
  auto r = m.push("abEND");
  EXPECT_EQ(r.emit, "ab");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(m.matched(), "END");
  EXPECT_EQ(m.matched_index(), 1);
}

TEST(StopMatcher, OverlappingPrefixes) {
  check_every_split({"abcd", "bce"}, "xabce", "xa", true);
  check_every_split({"ab", "abc"}, "zabc", "z", true);     // "ab" completes first
  check_every_split({"bc", "abc"}, "zabc", "z", true);     // same end: the longer
  check_every_split({"aab"}, "aaab", "a", true);
  check_every_split({"abab", "bac"}, "ababac", "", true);
  check_every_split({"abab", "bac"}, "abac", "a", true);
  check_every_split({"abab", "bac"}, "xabac", "xa", true);
  check_every_split({"aaa", "aab"}, "aaaab", "", true);
  check_every_split({"", "zz"}, "azbzz", "azb", true);
}

TEST(StopMatcher, NoStop) {
  check_every_split({"STOP", "<|end|>"}, "no stop here, just STO and <|en",
                    "no stop here, just STO and <|en", false);
  check_every_split({}, "anything", "anything", false);
  check_every_split({""}, "anything", "anything", false);
}

TEST(StopMatcher, HoldsBackOnlyWhatCouldMatch) {
  StopMatcher m({"STOP", "<|im_end|>"});
  auto r = m.push("Hello S");
  EXPECT_EQ(r.emit, "Hello ");
  EXPECT_EQ(m.held(), 1u);
  r = m.push("T");
  EXPECT_EQ(r.emit, "");
  r = m.push("X <|im");
  EXPECT_EQ(r.emit, "STX ");
  EXPECT_EQ(m.held(), 4u);
  r = m.push("_end|>after");
  EXPECT_EQ(r.emit, "");
  EXPECT_TRUE(r.stopped);
  r = m.push("more");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.emit, "");
  EXPECT_EQ(m.flush(), "");
}

}  // namespace
