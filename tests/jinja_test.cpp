// Unit tests of the Jinja interpreter (text/jinja.h).
//
// The *MatchesJinja2 tests hold small templates with the output Python's
// Jinja2 3.1 gives for them in transformers' chat-template environment
// (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
// json.dumps-based tojson); the other tests cover errors, limits and options.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/jinja.h"

namespace {

using json = nlohmann::ordered_json;
using lily::text::JinjaOptions;
using lily::text::JinjaRaisedError;
using lily::text::JinjaTemplate;

std::string render(const std::string& tpl, const json& vars = json::object(), JinjaOptions opt = {}) {
  return JinjaTemplate(tpl, "t", opt).render(vars);
}

void expect_render(const std::string& tpl, const std::string& vars, const std::string& expected) {
  std::string got;
  try {
    got = render(tpl, json::parse(vars));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "template:\n" << tpl << "\nthrew: " << e.what();
    return;
  }
  EXPECT_EQ(got, expected) << "template:\n" << tpl << "\nvariables: " << vars;
}

// The error message of rendering tpl; fails the test if it renders.
std::string error_of(const std::string& tpl, const json& vars = json::object(), JinjaOptions opt = {}) {
  try {
    std::string out = render(tpl, vars, opt);
    ADD_FAILURE() << "expected an error from:\n" << tpl << "\ngot output: " << out.substr(0, 200);
  } catch (const lily::Error& e) {
    return e.what();
  }
  return "";
}

TEST(JinjaWhitespace, MatchesJinja2) {
  expect_render(R"J(a
  {% if true %}
    x
  {% endif %}
b)J",
                R"J({})J",
                R"J(a
    x
b)J");
  expect_render(R"J(a
  {%- if true -%}
    x
  {%- endif -%}
b)J",
                R"J({})J",
                R"J(axb)J");
  expect_render(R"J(a
  {%+ if true %}x{% endif %}
)J",
                R"J({})J",
                R"J(a
  x)J");
  expect_render(R"J(a  {% if true %}x{% endif +%}
b)J",
                R"J({})J",
                R"J(a  x
b)J");
  expect_render(R"J(  {# comment #}
x)J",
                R"J({})J",
                R"J(x)J");
  expect_render(R"J(a {#- c -#} b)J",
                R"J({})J",
                R"J(ab)J");
  expect_render(R"J({{ 'x' }}
{{ 'y' }}
)J",
                R"J({})J",
                R"J(x
y)J");
  expect_render(R"J(  {{- 'x' -}}  
 y)J",
                R"J({})J",
                R"J(xy)J");
  expect_render(R"J({% raw %}{{ x }} {% if %}{% endraw %}
z)J",
                R"J({})J",
                R"J({{ x }} {% if %}z)J");
  expect_render("line1\r\nline2\rline3\n",
                R"J({})J",
                R"J(line1
line2
line3)J");
  expect_render(R"J({% for i in [1, 2] %}
  {{ i }}
{% endfor %}
)J",
                R"J({})J",
                R"J(  1
  2
)J");
  expect_render(R"J(text  {% if true %}x{% endif %})J",
                R"J({})J",
                R"J(text  x)J");
  expect_render(R"J({% set x = 1 %}   {% set y = 2 %}
{{ x + y }})J",
                R"J({})J",
                R"J(   3)J");
}

TEST(JinjaLoop, MatchesJinja2) {
  expect_render(R"J({% for x in items %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }};{% endfor %})J",
                R"J({"items": ["a", "b", "c"]})J",
                R"J(1/0/3/2/True/False/3;2/1/2/1/False/False/3;3/2/1/0/False/True/3;)J");
  expect_render(R"J({% for x in items %}[{{ loop.previtem }}|{{ loop.nextitem }}|{{ loop.previtem is defined }}]{% endfor %})J",
                R"J({"items": ["a", "b", "c"]})J",
                R"J([|b|False][a|c|True][b||True])J");
  expect_render(R"J({% for x in items %}{{ x }}{% else %}empty{% endfor %})J",
                R"J({"items": []})J",
                R"J(empty)J");
  expect_render(R"J({% for x in items if x > 1 %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% endfor %})J",
                R"J({"items": [1, 2, 3, 0, 5]})J",
                R"J(2:1/3 3:2/3 5:3/3 )J");
  expect_render(R"J({% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}|{% for k in d %}{{ k }}{% endfor %})J",
                R"J({"d": {"b": 1, "a": 2}})J",
                R"J(b=1;a=2;|b=1;a=2;|ba)J");
  expect_render(R"J({% for c in 'héllo' %}{{ c }}-{% endfor %})J",
                R"J({})J",
                R"J(h-é-l-l-o-)J");
  expect_render(R"J({% for x in [1, 2, 3, 4, 5] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %})J",
                R"J({})J",
                R"J(13)J");
  expect_render(R"J({% for x in xs %}{% for y in ys %}{{ loop.index }}{{ x }}{{ y }} {% endfor %}{{ loop.index }}|{% endfor %})J",
                R"J({"xs": [1, 2], "ys": ["a", "b"]})J",
                R"J(11a 21b 1|12a 22b 2|)J");
  expect_render(R"J({% for x in [1, 2, 3] %}{{ loop.cycle('odd', 'even') }} {% endfor %})J",
                R"J({})J",
                R"J(odd even odd )J");
  expect_render(R"J({% for x in [1, 1, 2, 2, 3] %}{% if loop.changed(x) %}{{ x }}{% endif %}{% endfor %})J",
                R"J({})J",
                R"J(123)J");
  expect_render(R"J({% set x = 5 %}{% for i in [1] %}{% set x = 7 %}{{ x }}{% endfor %}{{ x }})J",
                R"J({})J",
                R"J(75)J");
  expect_render(R"J({% for (a, b) in [[1, 2], [3, 4]] %}{{ a }}{{ b }}{% endfor %})J",
                R"J({})J",
                R"J(1234)J");
  expect_render(R"J({% for a in undefined_thing %}x{% else %}nothing{% endfor %})J",
                R"J({})J",
                R"J(nothing)J");
  expect_render(R"J({% for m in messages[::-1] %}{{ (messages|length - 1) - loop.index0 }}{{ m }} {% endfor %})J",
                R"J({"messages": ["a", "b", "c"]})J",
                R"J(2c 1b 0a )J");
}

TEST(JinjaSet, MatchesJinja2) {
  expect_render(R"J({% set ns = namespace(count=0, found=false) %}{% for i in range(4) %}{% set ns.count = ns.count + i %}{% if i == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }})J",
                R"J({})J",
                R"J(6 True)J");
  expect_render(R"J({% set a, b = 1, 2 %}{{ a }}{{ b }}|{% set t = 1, 2 %}{{ t }})J",
                R"J({})J",
                R"J(12|(1, 2))J");
  expect_render(R"J({% set x %}hello {{ 'w' }}{% endset %}[{{ x }}]|{% set y | upper | trim %} hi {% endset %}[{{ y }}])J",
                R"J({})J",
                R"J([hello w]|[HI])J");
  expect_render(R"J({% set ns = namespace({'a': 1}, b=2) %}{% set ns.c = 3 %}{{ ns.a }}{{ ns.b }}{{ ns.c }})J",
                R"J({})J",
                R"J(123)J");
  expect_render(R"J({% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}])J",
                R"J({})J",
                R"J(3[])J");
  expect_render(R"J({% if true %}{% set inside_if = 'visible' %}{% endif %}{{ inside_if }})J",
                R"J({})J",
                R"J(visible)J");
  expect_render(R"J({% filter upper %}abc {{ 'd' }}{% endfilter %})J",
                R"J({})J",
                R"J(ABC D)J");
}

TEST(JinjaMacro, MatchesJinja2) {
  expect_render(R"J({% macro m(a, b='d', c=none) %}[{{ a }}|{{ b }}|{{ c }}]{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ m(1, c=3) }}{{ m() }})J",
                R"J({})J",
                R"J([1|d|None][1|2|None][1|d|3][|d|None])J");
  expect_render(R"J({% macro m(x) %}{{ x }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k=4) }})J",
                R"J({})J",
                R"J(1(2, 3){'k': 4})J");
  expect_render(R"J({% macro m() %}  x  {% endmacro %}[{{ m() }}]|[{{ m()|trim }}])J",
                R"J({})J",
                R"J([  x  ]|[x])J");
  expect_render(R"J({% set g = 'G' %}{% macro m() %}{{ g }}{% endmacro %}{{ m() }})J",
                R"J({})J",
                R"J(G)J");
  expect_render(R"J({% set ns = namespace(v=0) %}{% macro inc() %}{% set ns.v = ns.v + 1 %}{% endmacro %}{{ inc() }}{{ inc() }}{{ ns.v }})J",
                R"J({})J",
                R"J(2)J");
  expect_render(R"J({% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }})J",
                R"J({})J",
                R"J(54321)J");
  expect_render(R"J({% macro render(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}{{ p.text }}{% endfor %}{% endif %}{% endmacro %}{{ render('s') }}|{{ render([{'text': 'a'}, {'text': 'b'}]) }})J",
                R"J({})J",
                R"J(s|ab)J");
}

TEST(JinjaExpressions, MatchesJinja2) {
  expect_render(R"J({{ 1 }}|{{ 1.0 }}|{{ 1.5e10 }}|{{ 1e16 }}|{{ 1e15 }}|{{ 0.0001 }}|{{ 0.00001 }}|{{ -0.0 }}|{{ 1_000 }}|{{ 0x1F }}|{{ 0b101 }}|{{ 0o17 }})J",
                R"J({})J",
                R"J(1|1.0|15000000000.0|1e+16|1000000000000000.0|0.0001|1e-05|-0.0|1000|31|5|15)J");
  expect_render(R"J({{ none }}|{{ None }}|{{ true }}|{{ False }}|{{ undefined_x }}|)J",
                R"J({})J",
                R"J(None|None|True|False||)J");
  expect_render(R"J({{ [1, 'a', none, true, 1.5, [2], {'k': 'v'}] }}|{{ (1,) }}|{{ (1, 2) }}|{{ x }})J",
                R"J({"x": {"a": [1, 2.5, null, true, "s"]}})J",
                R"J([1, 'a', None, True, 1.5, [2], {'k': 'v'}]|(1,)|(1, 2)|{'a': [1, 2.5, None, True, 's']})J");
  expect_render(R"J({{ "it's" }}|{{ ['it\'s', 'say "hi"', 'tab\tnl\n', 'é'] }})J",
                R"J({})J",
                R"J(it's|["it's", 'say "hi"', 'tab\tnl\n', 'é'])J");
  expect_render(R"J({{ 'a' 'b' }}|{{ "\u00e9\U0001F600" }}|{{ '\d' }})J",
                R"J({})J",
                R"J(ab|é😀|\d)J");
  expect_render(R"J({{ 1/3 }}|{{ 2/2 }}|{{ 7//2 }}|{{ -7//2 }}|{{ 7%3 }}|{{ -7%3 }}|{{ 2**10 }}|{{ 2**-1 }}|{{ 7.5//2 }})J",
                R"J({})J",
                R"J(0.3333333333333333|1.0|3|-4|1|2|1024|0.5|3.0)J");
  expect_render(R"J({{ 1 + 2 * 3 }}|{{ (1 + 2) * 3 }}|{{ -2 ** 2 }}|{{ 10 - 2 - 3 }}|{{ true + 1 }})J",
                R"J({})J",
                R"J(7|9|4|5|2)J");
  expect_render(R"J({{ 'a' ~ 1 ~ none ~ true ~ [1] }}|{{ 'a' + 'b' }}|{{ 'ab' * 3 }}|{{ [1] * 2 }}|{{ [1] + [2] }})J",
                R"J({})J",
                R"J(a1NoneTrue[1]|ab|ababab|[1, 1]|[1, 2])J");
  expect_render(R"J({{ 1 == 1.0 }}|{{ 1 == true }}|{{ [1, 2] == [1, 2] }}|{{ {'a': 1} == {'a': 1} }}|{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ 'a' < 'b' }}|{{ 1 != 2 }})J",
                R"J({})J",
                R"J(True|True|True|True|True|False|True|True)J");
  expect_render(R"J({{ 'b' in 'abc' }}|{{ 2 in [1, 2] }}|{{ 'k' in {'k': 1} }}|{{ 3 not in [1] }}|{{ 'x' in u }})J",
                R"J({})J",
                R"J(True|True|True|True|False)J");
  expect_render(R"J({{ a and b }}|{{ a or b }}|{{ not a }}|{{ 'y' if a else 'n' }}|{{ 1 if false else 2 if false else 3 }}|{{ 'y' if a }}|)J",
                R"J({"a": 0, "b": "q"})J",
                R"J(0|q|True|n|3||)J");
  expect_render(R"J({{ x[1:3] }}|{{ x[::-1] }}|{{ x[-2:] }}|{{ x[:-1] }}|{{ x[::2] }}|{{ x[5:1:-1] }}|{{ x[-100:100] }}|{{ x[3:1] }})J",
                R"J({"x": [0, 1, 2, 3, 4, 5]})J",
                R"J([1, 2]|[5, 4, 3, 2, 1, 0]|[4, 5]|[0, 1, 2, 3, 4]|[0, 2, 4]|[5, 4, 3, 2]|[0, 1, 2, 3, 4, 5]|[])J");
  expect_render(R"J({{ s[1:3] }}|{{ s[::-1] }}|{{ s[-2:] }}|{{ s[0] }}|{{ s[-1] }}|{{ s[10] }}|)J",
                R"J({"s": "héllo wörld"})J",
                R"J(él|dlröw olléh|ld|h|d|d|)J");
  expect_render(R"J({{ x.0 }}|{{ x[-1] }}|{{ d.a }}|{{ d['a'] }}|{{ d.missing }}|{{ l[5] }}|{{ n.x }}|{{ d.items is callable }})J",
                R"J({"x": [7, 8], "d": {"a": 1}, "l": [1], "n": null})J",
                R"J(7|8|1|1||||True)J");
}

TEST(JinjaTests, MatchesJinja2) {
  expect_render(R"J({{ x is defined }}|{{ y is defined }}|{{ y is undefined }}|{{ n is none }}|{{ x is none }}|{{ x is not none }}|{{ not x is none }})J",
                R"J({"x": 1, "n": null})J",
                R"J(True|False|True|True|False|True|True)J");
  expect_render(R"J({% for v in vals %}{{ v is string }}{{ v is mapping }}{{ v is iterable }}{{ v is sequence }}{{ v is number }}{{ v is integer }}{{ v is float }}{{ v is boolean }}{{ v is true }}{{ v is false }};{% endfor %})J",
                R"J({"vals": ["s", {"a": 1}, [1], 1, 1.5, true, false, null]})J",
                R"J(TrueFalseTrueTrueFalseFalseFalseFalseFalseFalse;FalseTrueTrueTrueFalseFalseFalseFalseFalseFalse;FalseFalseTrueTrueFalseFalseFalseFalseFalseFalse;FalseFalseFalseFalseTrueTrueFalseFalseFalseFalse;FalseFalseFalseFalseTrueFalseTrueFalseFalseFalse;FalseFalseFalseFalseTrueFalseFalseTrueTrueFalse;FalseFalseFalseFalseTrueFalseFalseTrueFalseTrue;FalseFalseFalseFalseFalseFalseFalseFalseFalseFalse;)J");
  expect_render(R"J({{ u is iterable }}{{ u is mapping }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 2 is eq 2 }}{{ 1 is lt 2 }}{{ 'a' is in 'abc' }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ range is callable }}{{ 'upper' is filter }}{{ 'odd' is test }})J",
                R"J({})J",
                R"J(TrueFalseTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrue)J");
}

TEST(JinjaFilters, MatchesJinja2) {
  expect_render(R"J([{{ '  x  ' | trim }}][{{ 'xxaxx' | trim('x') }}]|{{ 'héllo' | length }}|{{ [1, 2] | length }}|{{ {'a': 1} | length }}|{{ u | length }}|{{ [1, 2] | count }})J",
                R"J({})J",
                R"J([x][a]|5|2|1|0|2)J");
  expect_render(R"J({{ 1 | string }}{{ none | string }}{{ [1, 'a'] | string }}{{ 1.0 | string }}{{ true | string }}|{{ [1] | safe }})J",
                R"J({})J",
                R"J(1None[1, 'a']1.0True|[1])J");
  expect_render(R"J({{ [1, 2, 3] | join(', ') }}|{{ ['a', 'b'] | join }}|{{ users | join(', ', attribute='name') }})J",
                R"J({"users": [{"name": "x"}, {"name": "y"}]})J",
                R"J(1, 2, 3|ab|x, y)J");
  expect_render(R"J({{ [1, 2, 3] | first }}|{{ [1, 2, 3] | last }}|{{ 'abc' | first }}|{{ [] | first }}|{{ 'abc' | last }})J",
                R"J({})J",
                R"J(1|3|a||c)J");
  expect_render(R"J({{ u | default('d') }}|{{ none | default('d') }}|{{ '' | default('d', true) }}|{{ 0 | d(5) }}|{{ u | d }}|)J",
                R"J({})J",
                R"J(d|None|d|0||)J");
  expect_render(R"J({{ 'Hello' | upper }} {{ 'Hello' | lower }} {{ 'hello world' | capitalize }} {{ 'hello wORLD-foo(bar' | title }})J",
                R"J({})J",
                R"J(HELLO hello Hello world Hello World-Foo(Bar)J");
  expect_render(R"J({{ 'aaa' | replace('a', 'b') }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'abc' | list }}|{{ {'a': 1, 'b': 2} | list }}|{{ {'a': 1, 'b': 2} | items | list }})J",
                R"J({})J",
                R"J(bbb|bba|['a', 'b', 'c']|['a', 'b']|[('a', 1), ('b', 2)])J");
  expect_render(R"J({{ users | map(attribute='name') | list }}|{{ users | map(attribute='age', default=0) | list }}|{{ ['a', 'b'] | map('upper') | join }})J",
                R"J({"users": [{"name": "x", "age": 3}, {"name": "y"}]})J",
                R"J(['x', 'y']|[3, 0]|AB)J");
  expect_render(R"J({{ users | selectattr('active') | map(attribute='name') | list }}|{{ users | rejectattr('active') | map(attribute='name') | list }}|{{ users | selectattr('name', 'equalto', 'y') | map(attribute='name') | list }}|{{ [1, 2, 3, 4] | select('odd') | list }}|{{ [1, 2, 3, 4] | reject('odd') | list }})J",
                R"J({"users": [{"name": "x", "active": true}, {"name": "y", "active": false}]})J",
                R"J(['x']|['y']|['y']|[1, 3]|[2, 4])J");
  expect_render(R"J({{ '42' | int }}|{{ '42.9' | int }}|{{ 'x' | int }}|{{ 'x' | int(7) }}|{{ 3.9 | int }}|{{ -3.9 | int }}|{{ '0x1A' | int(0, 16) }}|{{ '4.5' | float }}|{{ 'x' | float }}|{{ 3 | float }})J",
                R"J({})J",
                R"J(42|42|0|7|3|-3|26|4.5|0.0|3.0)J");
  expect_render(R"J({{ -3 | abs }}|{{ -3.5 | abs }}|{{ 2.5 | round }}|{{ 3.5 | round }}|{{ 2.675 | round(2) }}|{{ 2.1 | round(method='ceil') }}|{{ 2.9 | round(0, 'floor') }}|{{ 3 | round }})J",
                R"J({})J",
                R"J(3|3.5|2.0|4.0|2.67|3.0|2.0|3)J");
  expect_render(R"J([{{ 'a\nb\n\nc' | indent }}][{{ 'a\nb' | indent(2, true) }}][{{ 'a\n\nb' | indent(2, blank=true) }}][{{ 'a\nb' | indent('> ') }}])J",
                R"J({})J",
                R"J([a
    b

    c][  a
  b][a
  
  b][a
> b])J");
  expect_render(R"J({{ [3, 1, 2] | sort }}|{{ [3, 1, 2] | sort(reverse=true) }}|{{ ['b', 'A', 'c'] | sort }}|{{ [1, 2, 1, 3] | unique | list }}|{{ [3, 1, 2] | min }}|{{ [3, 1, 2] | max }}|{{ [1, 2, 3] | sum }}|{{ {'b': 1, 'a': 2} | dictsort }})J",
                R"J({})J",
                R"J([1, 2, 3]|[3, 2, 1]|['A', 'b', 'c']|[1, 2, 3]|1|3|6|[('a', 2), ('b', 1)])J");
  expect_render(R"J({{ 'abc' | reverse }}|{{ [1, 2, 3] | reverse | list }}|{{ 'hi' | center(6) }}|{{ 'a b  c' | wordcount }}|{{ '<a>&"' | e }}|{{ '%s=%d' | format('a', 1) }}|{{ 'hello world foo' | truncate(9) }})J",
                R"J({})J",
                R"J(cba|[3, 2, 1]|  hi  |3|&lt;a&gt;&amp;&#34;|a=1|hello...)J");
  expect_render(R"J({{ range(5) | list }}|{{ range(1, 10, 3) | list }}|{{ range(5, 0, -2) | list }}|{{ dict(a=1, b=2) }})J",
                R"J({})J",
                R"J([0, 1, 2, 3, 4]|[1, 4, 7]|[5, 3, 1]|{'a': 1, 'b': 2})J");
}

TEST(JinjaMethods, MatchesJinja2) {
  expect_render(R"J({{ s.startswith('he') }}{{ s.endswith('lo') }}{{ s.startswith(('x', 'h')) }}|[{{ p.strip() }}][{{ p.lstrip() }}][{{ p.rstrip() }}][{{ p.strip(' h') }}][{{ '\n\nx\n'.strip('\n') }}])J",
                R"J({"s": "hello", "p": "  hello  "})J",
                R"J(TrueTrueTrue|[hello][hello  ][  hello][ello][x])J");
  expect_render(R"J({{ s.split() }}|{{ s.split(',') }}|{{ s.split(',', 1) }}|{{ s.rsplit(',', 1) }}|{{ '  a  b '.split(None, 1) }}|{{ 'x</think>y'.split('</think>')[-1] }})J",
                R"J({"s": "a,b,c"})J",
                R"J(['a,b,c']|['a', 'b', 'c']|['a', 'b,c']|['a,b', 'c']|['a', 'b ']|y)J");
  expect_render(R"J({{ s.replace('l', 'L') }}|{{ s.upper() }}|{{ s.lower() }}|{{ s.title() }}|{{ s.capitalize() }})J",
                R"J({"s": "heLlo wOrld it's"})J",
                R"J(heLLo wOrLd it's|HELLO WORLD IT'S|hello world it's|Hello World It'S|Hello world it's)J");
  expect_render(R"J({{ s.find('l') }}|{{ s.find('z') }}|{{ s.rfind('l') }}|{{ s.find('ö') }}|{{ s.count('l') }})J",
                R"J({"s": "héllo wörld"})J",
                R"J(2|-1|9|7|3)J");
  expect_render(R"J({{ '-'.join(['a', 'b']) }}|{{ 'abc'.isalpha() }}|{{ '123'.isdigit() }}|{{ '{} and {}'.format(1, 'x') }}|{{ '%s-%d-%05.2f' % ('a', 3, 2.5) }})J",
                R"J({})J",
                R"J(a-b|True|True|1 and x|a-3-02.50)J");
  expect_render(R"J({{ d.get('a') }}|{{ d.get('z') }}|{{ d.get('z', 5) }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ d.items() | list }})J",
                R"J({"d": {"a": 1, "b": 2}})J",
                R"J(1|None|5|['a', 'b']|[1, 2]|[('a', 1), ('b', 2)])J");
}

TEST(JinjaToJson, MatchesJinja2) {
  expect_render(R"J({{ x | tojson }})J",
                R"J({"x": {"b": 1, "a": [1, 2, {"x": "é\"\n\t\u0001"}], "c": null, "d": true, "e": 1.5, "f": 1.0, "g": 1e+20}})J",
                R"J({"b": 1, "a": [1, 2, {"x": "é\"\n\t\u0001"}], "c": null, "d": true, "e": 1.5, "f": 1.0, "g": 1e+20})J");
  expect_render(R"J({{ x | tojson(indent=2) }})J",
                R"J({"x": {"b": 1, "a": [1, 2, {"x": "é\"\n\t\u0001"}], "c": null, "d": true, "e": 1.5, "f": 1.0, "g": 1e+20}})J",
                R"J({
  "b": 1,
  "a": [
    1,
    2,
    {
      "x": "é\"\n\t\u0001"
    }
  ],
  "c": null,
  "d": true,
  "e": 1.5,
  "f": 1.0,
  "g": 1e+20
})J");
  expect_render(R"J({{ x | tojson(ensure_ascii=true) }}|{{ x | tojson(separators=(',', ':')) }}|{{ x | tojson(sort_keys=true) }})J",
                R"J({"x": {"k": "é😀", "a": [1, 2]}})J",
                R"J({"k": "\u00e9\ud83d\ude00", "a": [1, 2]}|{"k":"é😀","a":[1,2]}|{"a": [1, 2], "k": "é😀"})J");
  expect_render(R"J({{ [] | tojson(indent=2) }}{{ {} | tojson }}|{{ none | tojson }}|{{ 'x' | tojson }}|{{ (1, 2) | tojson }}|{{ {1: 2, none: 3, true: 4} | tojson }})J",
                R"J({})J",
                R"J([]{}|null|"x"|[1, 2]|{"1": 4, "null": 3})J");
}

// ---------------------------------------------------------------- errors

TEST(JinjaErrors, SyntaxErrorsNameTheLine) {
  EXPECT_EQ(error_of("line1\n{% if x %}\nok\n{% endfor %}"),
            "t:4: syntax error: unknown tag 'endfor' (expected 'elif' or 'else' or 'endif')");
  EXPECT_EQ(error_of("a\n\n{% for x in y %}\nno end"),
            "t:4: syntax error: unexpected end of template: 'for' opened on line 3 needs 'endfor' or 'else'");
  EXPECT_EQ(error_of("x\n{{ (1, 2 }}"), "t:2: syntax error: unexpected '}', expected ')'");
  EXPECT_EQ(error_of("a\nb\n{{ 1 + }}"), "t:3: syntax error: unexpected end of print statement '}}'");
  EXPECT_EQ(error_of("{{ 'unterminated }}"), "t:1: syntax error: unterminated string literal");
  EXPECT_EQ(error_of("{# never closed"), "t:1: syntax error: missing end of comment tag");
  EXPECT_EQ(error_of("{% foo %}"), "t:1: syntax error: unknown tag 'foo'");
  EXPECT_EQ(error_of("{% break %}"), "t:1: syntax error: 'break' outside of a loop");
  EXPECT_EQ(error_of("{% macro m(a=1, b) %}{% endmacro %}"),
            "t:1: syntax error: non-default argument follows default argument");
  EXPECT_EQ(error_of("{% include 'x' %}"), "t:1: syntax error: the 'include' tag is not supported");
  EXPECT_EQ(error_of("{{ x ]] }}"), "t:1: syntax error: unexpected ']'");
}

TEST(JinjaErrors, UnknownFilterOrTestIsASyntaxError) {
  EXPECT_EQ(error_of("\n{{ x | frobnicate }}"), "t:2: syntax error: no filter named 'frobnicate'");
  EXPECT_EQ(error_of("{{ x is frobnicated }}"), "t:1: syntax error: no test named 'frobnicated'");
  EXPECT_EQ(error_of("{{ [1] | map('nope') | list }}"), "t:1: no filter named 'nope'");
  // As in Jinja, inside `if` tests and branches and inline ifs they only fail when evaluated.
  EXPECT_EQ(render("{% if false and x is frobnicated %}{{ x | frobnicate }}{% else %}ok{% endif %}{{ 1 if true else 2 | nope }}"),
            "ok1");
  EXPECT_EQ(error_of("{% if true %}\n{{ x | frobnicate }}{% endif %}"), "t:2: no filter named 'frobnicate'");
  EXPECT_EQ(error_of("{% if true %}{% for i in [1] %}{{ i | frobnicate }}{% endfor %}{% endif %}"),
            "t:1: syntax error: no filter named 'frobnicate'");
}

TEST(JinjaSyntax, UnicodeIdentifiersAndOddLiterals) {
  EXPECT_EQ(render("{% set café = 'x' %}{{ café }}{{ 1e999 }}{{ -1e999 }}{{ 1e-999 }}"), "xinf-inf0.0");
  EXPECT_EQ(render("ab{#"), "ab");  // an empty comment opener at the very end is dropped, as in Jinja
}

TEST(JinjaErrors, RaiseExceptionSurfacesTheMessage) {
  try {
    render("ok\n{% if not messages %}{{ raise_exception('No messages provided.') }}{% endif %}",
           json{{"messages", json::array()}});
    FAIL() << "expected JinjaRaisedError";
  } catch (const JinjaRaisedError& e) {
    EXPECT_EQ(e.template_message(), "No messages provided.");
    EXPECT_EQ(std::string(e.what()), "t:2: raise_exception: No messages provided.");
  }
  // It is a lily::Error like every other template error.
  EXPECT_EQ(error_of("{{ raise_exception('x' ~ 1) }}"), "t:1: raise_exception: x1");
}

TEST(JinjaErrors, RuntimeErrorsNameTheLine) {
  EXPECT_EQ(error_of("a\n{{ 'a' + 1 }}"), "t:2: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(error_of("{{ 1 + 'a' }}"), "t:1: unsupported operand type(s) for +: 'int' and 'str'");
  EXPECT_EQ(error_of("{{ 1 / 0 }}"), "t:1: division by zero");
  EXPECT_EQ(error_of("\n\n{{ u + 1 }}"), "t:3: 'u' is undefined");
  EXPECT_EQ(error_of("{{ u.attr }}"), "t:1: 'u' is undefined");
  EXPECT_EQ(error_of("{{ d.missing.x }}", json{{"d", json::object()}}), "t:1: 'dict object' has no attribute 'missing'");
  EXPECT_EQ(error_of("{{ 1 < 'a' }}"), "t:1: '<' not supported between instances of 'int' and 'str'");
  EXPECT_EQ(error_of("{{ [1][::0] }}"), "t:1: slice step cannot be zero");
  EXPECT_EQ(error_of("{% for a in none %}{% endfor %}"), "t:1: 'NoneType' object is not iterable");
  EXPECT_EQ(error_of("{% for a, b in [[1, 2, 3]] %}{% endfor %}"), "t:1: too many values to unpack (expected 2)");
  EXPECT_EQ(error_of("{% set x = 1 %}{% set x.y = 2 %}"), "t:1: cannot assign attribute on non-namespace object 'x'");
  EXPECT_EQ(error_of("{{ 5 | length }}"), "t:1: object of type 'int' has no len()");
  EXPECT_EQ(error_of("{{ u | tojson }}"), "t:1: Object of type Undefined is not JSON serializable");
  EXPECT_EQ(error_of("{{ l.append(1) }}", json{{"l", json::array()}}),
            "t:1: access to attribute 'append' of 'list' object is unsafe");
  EXPECT_EQ(error_of("{{ 'x'.nope() }}"), "t:1: 'str object' has no attribute 'nope'");
  EXPECT_EQ(error_of("{{ 9223372036854775807 + 1 }}"), "t:1: integer overflow");
  EXPECT_EQ(error_of("{{ 1 }}", json::array()), "t: template variables must be a JSON object");
}

// ---------------------------------------------------------------- limits

TEST(JinjaLimits, NestingDepthIsBounded) {
  EXPECT_EQ(error_of("{{" + std::string(10000, '(') + "1" + std::string(10000, ')') + "}}"),
            "t:1: syntax error: nesting deeper than 200 levels");
  std::string nots;
  for (int i = 0; i < 100000; ++i) nots += "not ";
  EXPECT_EQ(error_of("{{ " + nots + "1 }}"), "t:1: syntax error: nesting deeper than 200 levels");
  std::string ifs, endifs;
  for (int i = 0; i < 5000; ++i) {
    ifs += "{% if 1 %}";
    endifs += "{% endif %}";
  }
  EXPECT_EQ(error_of(ifs + endifs), "t:1: syntax error: nesting deeper than 200 levels");
  JinjaOptions opt;
  opt.max_nesting_depth = 5;
  EXPECT_EQ(error_of("{{ ((((((1)))))) }}", json::object(), opt), "t:1: syntax error: nesting deeper than 5 levels");
}

TEST(JinjaLimits, RecursionIsBounded) {
  EXPECT_EQ(error_of("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
            "t:1: nesting deeper than 500 levels while rendering (runaway macro recursion?)");
}

TEST(JinjaLimits, IterationsAreBounded) {
  EXPECT_EQ(error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
            "t:1: more than 1000000 loop iterations and macro calls");
  JinjaOptions opt;
  opt.max_iterations = 10;
  EXPECT_EQ(render("{% for i in range(10) %}{{ i }}{% endfor %}", json::object(), opt), "0123456789");
  EXPECT_EQ(error_of("{% for i in range(11) %}{% endfor %}", json::object(), opt),
            "t:1: more than 10 loop iterations and macro calls");
  EXPECT_EQ(error_of("{{ range(100001) | length }}"), "t:1: range too big: more than 100000 items");
}

TEST(JinjaLimits, SizesAreBounded) {
  EXPECT_EQ(error_of("{{ 'a' * 1000000000000 }}"), "t:1: string larger than the 67108864-byte limit");
  EXPECT_EQ(error_of("{{ [1] * 1000000000000 }}"), "t:1: list longer than the 1000000-item limit");
  JinjaOptions small;
  small.max_output_bytes = 1000;
  small.max_iterations = 1000;
  EXPECT_EQ(error_of("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                     json::object(), small),
            "t:1: string larger than the 1000-byte limit");
  EXPECT_EQ(error_of("{% set ns = namespace(s=[1]) %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                     json::object(), small),
            "t:1: list longer than the 1000-item limit");
  EXPECT_EQ(error_of("{{ 'ab'.replace('', 'x' * 400) }}", json::object(), small),
            "t:1: string larger than the 1000-byte limit");
  EXPECT_EQ(error_of("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}"),
            "t:1: value nested more than 256 levels deep");
  JinjaOptions opt;
  opt.max_output_bytes = 100;
  EXPECT_EQ(render("{% for i in range(10) %}0123456789{% endfor %}", json::object(), opt).size(), 100u);
  EXPECT_EQ(error_of("{% for i in range(11) %}0123456789{% endfor %}", json::object(), opt),
            "t:1: output larger than the 100-byte limit");
  json deep = json::array();
  for (int i = 0; i < 300; ++i) deep = json::array({deep});
  EXPECT_EQ(error_of("{{ x }}", json{{"x", deep}}), "t: input nested more than 256 levels deep");
}

TEST(JinjaLimits, SelfReferenceDoesNotRecurse) {
  EXPECT_EQ(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}"), "<Namespace {'me': <Namespace>}>");
  // A macro kept past the loop that defined it still works.
  EXPECT_EQ(render("{% set ns = namespace() %}{% for i in [1] %}{% macro m() %}M{{ i }}{% endmacro %}"
                   "{% set ns.m = m %}{% endfor %}{{ ns.m() }}"),
            "M1");
}

// ---------------------------------------------------------------- options, API

TEST(JinjaOptionsTest, TrimAndLstripCanBeTurnedOff) {
  JinjaOptions opt;
  opt.trim_blocks = false;
  opt.lstrip_blocks = false;
  EXPECT_EQ(render("a\n  {% if true %}\n  x\n  {% endif %}\nb", json::object(), opt), "a\n  \n  x\n  \nb");
  opt.keep_trailing_newline = true;
  EXPECT_EQ(render("x\n", json::object(), opt), "x\n");
  EXPECT_EQ(render("x\n"), "x");
}

TEST(JinjaApi, KeyOrderOfInputsIsKept) {
  json v = json::parse(R"({"tool": {"z": 1, "a": {"y": [1, 2.0, "é"], "b": null}}})");
  EXPECT_EQ(render("{{ tool | tojson }}|{% for k in tool %}{{ k }}{% endfor %}", v),
            R"({"z": 1, "a": {"y": [1, 2.0, "é"], "b": null}}|za)");
  EXPECT_EQ(render("{{ x }}", json{{"x", json::parse("[1.0, 100, 1e100, -0.5]")}}), "[1.0, 100, 1e+100, -0.5]");
}

TEST(JinjaApi, StrftimeNowAndName) {
  JinjaTemplate t("{{ strftime_now('%Y') | length }}", "named.jinja");
  EXPECT_EQ(t.name(), "named.jinja");
  EXPECT_EQ(t.render(nullptr), "4");
}

TEST(JinjaApi, RendersConcurrently) {
  JinjaTemplate t("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}");
  std::vector<std::thread> threads;
  std::vector<std::string> results(8);
  for (size_t i = 0; i < results.size(); ++i)
    threads.emplace_back([&, i] {
      json xs = json::array();
      for (int k = 0; k <= static_cast<int>(i) * 100; ++k) xs.push_back(k);
      for (int rep = 0; rep < 20; ++rep) results[i] = t.render(json{{"xs", xs}});
    });
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < results.size(); ++i) {
    int64_t n = static_cast<int64_t>(i) * 100;
    EXPECT_EQ(results[i], std::to_string(n * (n + 1) / 2));
  }
}

}  // namespace
