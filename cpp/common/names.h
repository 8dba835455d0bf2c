// The name table of an enum that Python names by string: one list serves enum -> name, name -> enum
// and _core.option_names(), so the three cannot disagree. Canonical names only; the Python layer
// turns users' spellings into these before calling the core.
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace corelm {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

template <class E, size_t N>
const char* name_of(const EnumName<E> (&table)[N], E value) {
  for (const EnumName<E>& e : table)
    if (e.value == value) return e.name;
  return "?";
}

template <class E, size_t N>
std::vector<std::string> names_of(const EnumName<E> (&table)[N]) {
  std::vector<std::string> out;
  for (const EnumName<E>& e : table) out.push_back(e.name);
  return out;
}

// The value named `name`; otherwise std::invalid_argument "<what> must be 'a', 'b' or 'c', got 'x'".
template <class E, size_t N>
E parse_name(const EnumName<E> (&table)[N], const std::string& name, const char* what) {
  std::string choices;
  for (size_t i = 0; i < N; i++) {
    if (name == table[i].name) return table[i].value;
    choices += std::string(i == 0 ? "" : i + 1 == N ? " or " : ", ") + "'" + table[i].name + "'";
  }
  throw std::invalid_argument(std::string(what) + " must be " + choices + ", got '" + name + "'");
}

}  // namespace corelm
