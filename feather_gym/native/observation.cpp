// The Feather observation's arithmetic (module feather_gym._observation).
//
// feather_gym.observation is the contract: its docstring tables the features, and it passes its
// normalisation here once. FeatureKernel turns what a scheduler view reports into the raw
// feature rows and the normalised observation, for the simulator and the engine alike.
//
// Inputs, per candidate i (c of them, 1 <= c <= k): its CHT statistics (a row of
// ChunkedHashTree.candidate_rows: shared, missing, chunk_loss, same_prefix_waiting, num_chunks),
// its context tokens, its resumable shared blocks and its resumable resident blocks; per
// decision: the running requests, the running common prefix in tokens, the KV utilisation, the
// waiting requests, the oldest wait in steps, and the block size in tokens.
//
// Invariants: rows past c are zero; the observation is k rows normalised (clip((raw - offset) *
// inv_scale, 0, clip)) and then the k - 1 slot masks (1 filled, 0 empty).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr size_t kFeatures = 10;
// Column order of feather_gym.observation.FEATURE_NAMES.
enum Feature {
  kBatchSize, kChunkLoss, kSamePrefix, kCommonPrefix, kContext, kCachedFraction, kKvUtilisation, kNumWaiting,
  kOldestWait, kResident
};
// Columns of ChunkedHashTree.candidate_rows.
enum Stat { kShared, kMissing, kLoss, kSame, kChunks };

using Stats = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;

class FeatureKernel {
 public:
  FeatureKernel(const Floats& offsets, const Floats& inv_scales, float clip) : clip_(clip) {
    if (offsets.size() != static_cast<py::ssize_t>(kFeatures) || inv_scales.size() != offsets.size()) {
      throw std::invalid_argument("the observation has " + std::to_string(kFeatures) + " features");
    }
    offsets_.assign(offsets.data(), offsets.data() + kFeatures);
    inv_scales_.assign(inv_scales.data(), inv_scales.data() + kFeatures);
  }

  static size_t num_features() { return kFeatures; }

  // Raw feature rows, float64 [k, F].
  py::array_t<double> raw_rows(const Stats& stats, const py::sequence& contexts, const py::sequence& resumable,
                               const py::sequence& resident, const py::tuple& scalars, int64_t block, size_t k) const {
    const size_t c = check(stats, contexts, resumable, resident, scalars, k);
    py::array_t<double> rows({k, kFeatures});
    double* out = rows.mutable_data();
    std::fill(out, out + k * kFeatures, 0.0);
    for (size_t i = 0; i < c; ++i) fill_row(out + i * kFeatures, stats, contexts, resumable, resident, scalars, block, i);
    return rows;
  }

  // The normalised observation, float32 [k * F + k - 1].
  py::array_t<float> observation(const Stats& stats, const py::sequence& contexts, const py::sequence& resumable,
                                 const py::sequence& resident, const py::tuple& scalars, int64_t block, size_t k) const {
    const size_t c = check(stats, contexts, resumable, resident, scalars, k);
    py::array_t<float> obs(static_cast<py::ssize_t>(k * kFeatures + k - 1));
    float* out = obs.mutable_data();
    std::fill(out, out + k * kFeatures + k - 1, 0.0f);
    double row[kFeatures];
    for (size_t i = 0; i < c; ++i) {
      fill_row(row, stats, contexts, resumable, resident, scalars, block, i);
      for (size_t f = 0; f < kFeatures; ++f) {
        out[i * kFeatures + f] = normalised(row[f], f);
      }
      if (i) out[k * kFeatures + i - 1] = 1.0f;
    }
    return obs;
  }

  // normalise() of rows [..., F] (any leading shape), float32 of the same shape.
  py::array_t<float> normalise(const Doubles& raw) const {
    if (raw.ndim() < 1 || raw.shape(raw.ndim() - 1) != static_cast<py::ssize_t>(kFeatures)) {
      throw std::invalid_argument("raw features must be [..., " + std::to_string(kFeatures) + "]");
    }
    std::vector<py::ssize_t> shape(raw.shape(), raw.shape() + raw.ndim());
    py::array_t<float> out(shape);
    const double* src = raw.data();
    float* dst = out.mutable_data();
    for (py::ssize_t j = 0; j < raw.size(); ++j) dst[j] = normalised(src[j], j % kFeatures);
    return out;
  }

 private:
  std::vector<float> offsets_, inv_scales_;
  float clip_;

  // In float32 throughout, as numpy computes float32 arrays: the raw value is rounded first.
  float normalised(double raw, size_t f) const {
    const float scaled = (static_cast<float>(raw) - offsets_[f]) * inv_scales_[f];
    return std::min(clip_, std::max(0.0f, scaled));
  }

  static size_t check(const Stats& stats, const py::sequence& contexts, const py::sequence& resumable,
                      const py::sequence& resident, const py::tuple& scalars, size_t k) {
    const size_t c = stats.ndim() == 2 ? static_cast<size_t>(stats.shape(0)) : 0;
    if (stats.ndim() != 2 || stats.shape(1) != 5 || c < 1 || c > k) {
      throw std::invalid_argument("stats must be [c, 5] with 1 <= c <= k = " + std::to_string(k));
    }
    if (static_cast<size_t>(py::len(contexts)) != c || static_cast<size_t>(py::len(resumable)) != c ||
        static_cast<size_t>(py::len(resident)) != c) {
      throw std::invalid_argument("one context, one resumable and one resident count per candidate");
    }
    if (py::len(scalars) != 5) {
      throw std::invalid_argument("scalars: (num_running, common_prefix_tokens, kv_utilisation, num_waiting, "
                                  "oldest_wait_steps)");
    }
    return c;
  }

  static void fill_row(double* row, const Stats& stats, const py::sequence& contexts, const py::sequence& resumable,
                       const py::sequence& resident, const py::tuple& scalars, int64_t block, size_t i) {
    const int64_t* s = stats.data() + i * 5;
    row[kBatchSize] = scalars[0].cast<double>();
    row[kChunkLoss] = static_cast<double>(s[kLoss] * block);
    row[kSamePrefix] = static_cast<double>(s[kSame]);
    row[kCommonPrefix] = scalars[1].cast<double>();
    row[kContext] = contexts[i].cast<double>();
    row[kCachedFraction] = s[kChunks] ? resumable[i].cast<double>() / static_cast<double>(s[kChunks]) : 0.0;
    row[kKvUtilisation] = scalars[2].cast<double>();
    row[kNumWaiting] = scalars[3].cast<double>();
    row[kOldestWait] = scalars[4].cast<double>();
    row[kResident] = static_cast<double>(resident[i].cast<int64_t>() * block);
  }
};

}  // namespace

PYBIND11_MODULE(_observation, m) {
  m.doc() = "The Feather observation's arithmetic (see feather_gym.observation).";
  py::class_<FeatureKernel>(m, "FeatureKernel")
      .def(py::init<const Floats&, const Floats&, float>(), py::arg("offsets"), py::arg("inv_scales"),
           py::arg("clip"))
      .def_property_readonly_static("num_features", [](py::object) { return FeatureKernel::num_features(); })
      .def("raw_rows", &FeatureKernel::raw_rows)
      .def("observation", &FeatureKernel::observation)
      .def("normalise", &FeatureKernel::normalise);
}
