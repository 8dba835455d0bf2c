// The name table of an enum that Python names by string: one list serves enum -> name, name -> enum
// and _core.option_names(), so the three cannot disagree. Canonical names only; the Python layer
// turns users' spellings into these before calling the core. A table is an array of rows with a `value`
// and a `name`: EnumName, or a wider row (formats/traits.h's WeightTraits, whose other name columns
// `field` picks; rows without that name are skipped).
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace corelm {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

template <class Row, size_t N, class E>
const char* name_of(const Row (&table)[N], E value) {
  for (const Row& e : table)
    if (e.value == value) return e.name;
  return "?";
}

template <class Row, size_t N>
std::vector<std::string> names_of(const Row (&table)[N], const char* const Row::*field = &Row::name) {
  std::vector<std::string> out;
  for (const Row& e : table)
    if (e.*field) out.push_back(e.*field);
  return out;
}

// The value named `name`; otherwise std::invalid_argument "<what> must be 'a', 'b' or 'c', got 'x'".
template <class Row, size_t N>
std::remove_cv_t<decltype(Row::value)> parse_name(const Row (&table)[N], const std::string& name, const char* what,
                                                  const char* const Row::*field = &Row::name) {
  for (const Row& e : table)
    if (e.*field && name == e.*field) return e.value;
  const std::vector<std::string> names = names_of(table, field);
  std::string choices;
  for (size_t i = 0; i < names.size(); i++)
    choices += std::string(i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + "'" + names[i] + "'";
  throw std::invalid_argument(std::string(what) + " must be " + choices + ", got '" + name + "'");
}

}  // namespace corelm
