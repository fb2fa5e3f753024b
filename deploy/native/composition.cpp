// deploy.step_log.step_composition, maintained across steps (module deploy._composition).
//
// DecodeComposition keeps, per request that decoded in the last step it was scheduled, the keys of
// the full blocks it counts, with a reference count per counted block and per first block. A step
// counts the blocks its decoding requests newly filled; a request that stops decoding is uncounted
// at once when it leaves the engine (leave()), else (preempted, or not scheduled) at the first step
// that does not decode it. Per step: O(scheduled requests) cheap checks read from the scheduler
// output's own lists (a counted decoder's request object is read only when a block can have
// filled), plus O(blocks) once per request that starts or stops decoding.
//
// A block is identified by the first 8 bytes of its hash (little endian), as the CHT reads vLLM's
// block hashes (traces.chunk_hash.block_hash_digests): equal to the scan's identity by whole hashes
// up to a 2**-64 collision.
//
// Invariant: update() returns exactly what step_composition computes for the same step
// (tests/test_bench_scheduler.py checks it step by step, under preemption).

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

struct PyKeyHash {
  size_t operator()(const py::object& o) const { return static_cast<size_t>(PyObject_Hash(o.ptr())); }
};
struct PyKeyEqual {
  bool operator()(const py::object& a, const py::object& b) const {
    return a.ptr() == b.ptr() || PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ) == 1;
  }
};

struct Counted {
  std::vector<uint64_t> blocks;   // the keys of the full blocks it counts
  int64_t prompt = 0;             // its prompt tokens
  int64_t next = 0;               // the next `before` at which a block can have filled
  int64_t seen = 0;               // the last step that decoded it
};

class DecodeComposition {
 public:
  explicit DecodeComposition(int64_t block_size) : block_size_(block_size) {
    if (block_size < 1) throw std::invalid_argument("block_size must be >= 1");
  }

  int64_t block_size() const { return block_size_; }

  // The request left the engine: uncount it (a no-op when it was not counted).
  void leave(const py::object& request_id) {
    auto found = counted_.find(request_id);
    if (found == counted_.end()) return;
    uncount(found->second);
    ungrouped_ -= found->second.blocks.empty();
    counted_.erase(found);
  }

  // The composition of the step just scheduled (read after schedule()).
  py::dict update(const py::handle& scheduler_output, const py::dict& requests) {
    PyObject* scheduled = attr(scheduler_output.ptr(), "num_scheduled_tokens");
    PyObject* fresh_reqs = attr(scheduler_output.ptr(), "scheduled_new_reqs");
    PyObject* cached = attr(scheduler_output.ptr(), "scheduled_cached_reqs");
    PyObject* cached_ids = attr(cached, "req_ids");
    PyObject* cached_computed = attr(cached, "num_computed_tokens");
    step_ += 1;
    Tally tally;
    const Py_ssize_t fresh_count = PyList_Size(fresh_reqs), cached_count = PyList_Size(cached_ids);
    if (fresh_count < 0 || cached_count < 0 || PyList_Size(cached_computed) != cached_count ||
        fresh_count + cached_count != PyDict_Size(scheduled)) {
      release_all({scheduled, fresh_reqs, cached, cached_ids, cached_computed});
      throw std::invalid_argument("the scheduler output's new and cached requests are not its scheduled ones");
    }
    try {
      for (Py_ssize_t i = 0; i < fresh_count; ++i) {
        PyObject* data = PyList_GET_ITEM(fresh_reqs, i);
        PyObject* id = attr(data, "req_id");
        const int64_t before = int_attr(data, "num_computed_tokens");
        look_at(py::reinterpret_steal<py::object>(id), scheduled, requests, before, tally);
      }
      for (Py_ssize_t i = 0; i < cached_count; ++i) {
        py::object id = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(cached_ids, i));
        look_at(id, scheduled, requests, as_int(PyList_GET_ITEM(cached_computed, i)), tally);
      }
    } catch (...) {
      release_all({scheduled, fresh_reqs, cached, cached_ids, cached_computed});
      throw;
    }
    release_all({scheduled, fresh_reqs, cached, cached_ids, cached_computed});
    if (static_cast<int64_t>(counted_.size()) > tally.decode) {   // a counted request did not decode in this step
      std::vector<py::object> gone;
      for (auto& item : counted_) {
        if (item.second.seen != step_) gone.push_back(item.first);
      }
      for (auto& id : gone) leave(id);
    }
    const int64_t unique =
        static_cast<int64_t>(blocks_.size()) * block_size_ + (tally.kv - full_blocks_ * block_size_);
    py::dict out;
    out["decode_requests"] = tally.decode;
    out["decode_kv_tokens"] = tally.kv;
    out["decode_unique_kv_tokens"] = unique;
    out["decode_groups"] = static_cast<int64_t>(firsts_.size()) + ungrouped_;
    std::sort(tally.chunks.begin(), tally.chunks.end());
    py::list chunks;
    for (auto [fresh, before] : tally.chunks) {
      py::list chunk;
      chunk.append(fresh);
      chunk.append(before);
      chunks.append(chunk);
    }
    out["prefill_chunks"] = chunks;
    return out;
  }

 private:
  struct Tally {
    int64_t decode = 0, kv = 0;
    std::vector<std::pair<int64_t, int64_t>> chunks;   // [new, cached] per prefilling request
  };

  int64_t block_size_;
  int64_t step_ = 0;
  std::unordered_map<py::object, Counted, PyKeyHash, PyKeyEqual> counted_;
  std::unordered_map<uint64_t, int64_t> blocks_;   // block -> decoding requests counting it
  std::unordered_map<uint64_t, int64_t> firsts_;   // first block -> decoding requests counting it
  int64_t full_blocks_ = 0;                        // sum of the counted full blocks
  int64_t ungrouped_ = 0;                          // counted requests without a full block

  // One scheduled request, `before` tokens computed before this step. A counted request that
  // decodes again is settled from its entry alone (the scheduler output's own lists, no request
  // object read) unless a block can have filled since it was last looked at.
  void look_at(const py::object& id, PyObject* scheduled, const py::dict& requests, int64_t before, Tally& tally) {
    PyObject* count = PyDict_GetItemWithError(scheduled, id.ptr());
    if (count == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw std::invalid_argument("a scheduled request has no scheduled tokens");
    }
    const int64_t fresh = as_int(count);
    auto found = counted_.find(id);
    if (found != counted_.end() && fresh == 1 && before >= found->second.prompt) {
      tally.decode += 1;
      tally.kv += before + 1;
      found->second.seen = step_;
      if (before >= found->second.next) recount(found->second, request_of(requests, id), before);
      return;
    }
    PyObject* request = request_of(requests, id);
    const int64_t prompt = int_attr(request, "num_prompt_tokens");
    if (fresh != 1 || before < prompt) {
      tally.chunks.emplace_back(fresh, before);
      return;
    }
    tally.decode += 1;
    tally.kv += before + 1;
    if (found == counted_.end()) {
      found = counted_.emplace(id, Counted{{}, prompt, 0, step_}).first;
      ungrouped_ += 1;
    }
    found->second.prompt = prompt;
    found->second.seen = step_;
    if (before >= found->second.next) recount(found->second, request, before);
  }

  // A decoding request's counted blocks brought up to date.
  void recount(Counted& entry, PyObject* request, int64_t before) {
    py::object hashes = py::reinterpret_steal<py::object>(attr(request, "block_hashes"));
    const int64_t blocks = (before + 1) / block_size_;
    const int64_t full = std::min<int64_t>(static_cast<int64_t>(PyObject_Length(hashes.ptr())), blocks);
    const int64_t counted = static_cast<int64_t>(entry.blocks.size());
    if (full > counted) {
      ungrouped_ -= counted == 0;
      for (int64_t j = counted; j < full; ++j) {
        entry.blocks.push_back(block_key(hashes, j));
        blocks_[entry.blocks.back()] += 1;
      }
      if (counted == 0) firsts_[entry.blocks.front()] += 1;
      full_blocks_ += full - counted;
    }
    // `full` grows when before + 1 reaches the next block, or (hashes behind) once one is hashed
    entry.next = full == blocks ? (full + 1) * block_size_ - 1 : before + 1;
  }

  static PyObject* request_of(const py::dict& requests, const py::object& id) {
    PyObject* request = PyDict_GetItemWithError(requests.ptr(), id.ptr());
    if (request == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw std::invalid_argument("a scheduled request is not among the scheduler's requests");
    }
    return request;
  }

  // A new reference to object.name (the name interned once).
  static PyObject* attr(PyObject* object, const char* name) {
    static std::unordered_map<std::string, PyObject*> names;
    auto found = names.find(name);
    if (found == names.end()) found = names.emplace(name, PyUnicode_InternFromString(name)).first;
    PyObject* value = PyObject_GetAttr(object, found->second);
    if (value == nullptr) throw py::error_already_set();
    return value;
  }

  static int64_t as_int(PyObject* value) {
    const int64_t result = PyLong_AsLongLong(value);
    if (result == -1 && PyErr_Occurred()) throw py::error_already_set();
    return result;
  }

  static int64_t int_attr(PyObject* object, const char* name) {
    PyObject* value = attr(object, name);
    const int64_t result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (result == -1 && PyErr_Occurred()) throw py::error_already_set();
    return result;
  }

  static void release_all(std::initializer_list<PyObject*> objects) {
    for (PyObject* object : objects) Py_XDECREF(object);
  }

  static uint64_t block_key(const py::handle& hashes, int64_t j) {
    py::object hash = PyList_Check(hashes.ptr())
        ? py::reinterpret_borrow<py::object>(PyList_GET_ITEM(hashes.ptr(), j))
        : py::reinterpret_steal<py::object>(PySequence_GetItem(hashes.ptr(), j));
    char* data;
    Py_ssize_t size;
    if (!hash || PyBytes_AsStringAndSize(hash.ptr(), &data, &size) != 0) throw py::error_already_set();
    if (size < 8) throw std::invalid_argument("a block hash is shorter than 8 bytes");
    uint64_t key = 0;
    for (int b = 7; b >= 0; --b) key = (key << 8) | static_cast<unsigned char>(data[b]);
    return key;
  }

  void uncount(const Counted& entry) {
    if (entry.blocks.empty()) return;
    for (uint64_t block : entry.blocks) release(blocks_, block);
    release(firsts_, entry.blocks.front());
    full_blocks_ -= static_cast<int64_t>(entry.blocks.size());
  }

  static void release(std::unordered_map<uint64_t, int64_t>& counts, uint64_t key) {
    auto found = counts.find(key);
    if (--found->second == 0) counts.erase(found);
  }
};

}  // namespace

PYBIND11_MODULE(_composition, m) {
  m.doc() = "deploy.step_log.step_composition, maintained incrementally (see deploy.step_log).";
  py::class_<DecodeComposition>(m, "DecodeComposition")
      .def(py::init<int64_t>(), py::arg("block_size"))
      .def_property_readonly("block_size", &DecodeComposition::block_size)
      .def("leave", &DecodeComposition::leave)
      .def("update", &DecodeComposition::update);
}
