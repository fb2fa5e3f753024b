// The leading prefix-cache hits of a request, compiled (module deploy._prefix_hits).
//
// vLLM's full-attention lookup (FullAttentionManager.find_longest_cache_hit, its first phase) for
// one KV cache group whose block size is the hash block size: walk the request's block hashes in
// order and count those cached, up to the first miss. A hash is cached for group g when the key
// hash + g as 4 big-endian bytes (make_block_hash_with_group_id's layout) is in the block pool's
// map (BlockHashToBlockMap._cache), which holds a key exactly while a block is cached under it.
//
// Invariant: leading_hits(hashes, limit, table, suffix) is the number of leading entries h of
// hashes[:limit] with h + suffix in table. It reads and creates nothing that outlives the call.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace py = pybind11;

namespace {

py::ssize_t leading_hits(const py::list& hashes, py::ssize_t limit, const py::dict& table, const py::bytes& suffix) {
  const py::ssize_t n = std::min(limit, static_cast<py::ssize_t>(PyList_GET_SIZE(hashes.ptr())));
  const char* tail = PyBytes_AS_STRING(suffix.ptr());
  const py::ssize_t tail_len = PyBytes_GET_SIZE(suffix.ptr());
  py::ssize_t hits = 0;
  for (; hits < n; ++hits) {
    PyObject* hash = PyList_GET_ITEM(hashes.ptr(), hits);
    if (!PyBytes_Check(hash)) throw std::invalid_argument("block hashes must be bytes");
    const py::ssize_t len = PyBytes_GET_SIZE(hash);
    PyObject* key = PyBytes_FromStringAndSize(nullptr, len + tail_len);
    if (key == nullptr) throw py::error_already_set();
    std::memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(hash), static_cast<size_t>(len));
    std::memcpy(PyBytes_AS_STRING(key) + len, tail, static_cast<size_t>(tail_len));
    const int found = PyDict_Contains(table.ptr(), key);
    Py_DECREF(key);
    if (found < 0) throw py::error_already_set();
    if (!found) break;
  }
  return hits;
}

}  // namespace

PYBIND11_MODULE(_prefix_hits, m) {
  m.doc() = "The leading prefix-cache hits of a request (see deploy.resident_prefix).";
  m.def("leading_hits", &leading_hits, py::arg("hashes"), py::arg("limit"), py::arg("table"), py::arg("suffix"));
}
