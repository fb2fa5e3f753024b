// A dense feed-forward network evaluated in place (module feather_gym._dense).
//
// Layers y = W x + b, W row-major [out, in], with one activation (tanh or relu) after every layer
// but the last: the shape of the policy networks feather-gym exports. feather_gym.policy_runtime
// builds one from an ONNX file's weights and checks it against onnxruntime before serving with it.
//
// Invariants: consecutive layers chain (in of layer i+1 == out of layer i); evaluation allocates
// nothing (two scratch vectors sized at construction); a call holds no state between calls.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// Outputs computed together: their partial sums stay in registers while the input streams by.
constexpr size_t kBlock = 8;

struct Layer {
  size_t in, out;
  std::vector<float> weight;    // [ceil(out / kBlock), in, kBlock], zero-padded past `out`
  std::vector<float> bias;      // [ceil(out / kBlock) * kBlock], zero-padded past `out`
};

// Eight floats, one AVX register (two SSE ones on the baseline build), loaded and stored unaligned.
typedef float Lanes __attribute__((vector_size(32), aligned(4)));

// The vector helpers below are always inlined into apply_layer's clones, so no vector crosses a
// call between differently built code (GCC's -Wpsabi note does not apply).
#pragma GCC diagnostic ignored "-Wpsabi"

// tanh as onnxruntime's CPU kernel (MLAS) computes it: a rational approximation on [-9, 9].
__attribute__((always_inline)) inline Lanes rational_tanh(Lanes x) {
  const Lanes lo = Lanes{} - 9.0f, hi = Lanes{} + 9.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const Lanes x2 = x * x;
  Lanes p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  p = p * x;
  Lanes q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return p / q;
}

enum class Activation { kNone, kTanh, kRelu };

// out[0 .. round_up(out, 8)) = activation(W in + b), eight outputs at a time whose partial sums stay in
// a register while the input streams by (out has room for the padding; padded weights are zero).
// Built for AVX2 with FMA and for the baseline x86-64 alike; the loader picks the one the processor
// runs (GCC's function multi-versioning).
__attribute__((target_clones("arch=haswell", "default")))
void apply_layer(const Layer& layer, const float* in, float* out, Activation activation) {
  const Lanes zero = Lanes{};
  for (size_t j0 = 0; j0 < layer.out; j0 += kBlock) {
    Lanes acc = zero;
    const float* w = layer.weight.data() + j0 * layer.in;
    for (size_t c = 0; c < layer.in; ++c) acc += in[c] * *reinterpret_cast<const Lanes*>(w + c * kBlock);
    acc += *reinterpret_cast<const Lanes*>(layer.bias.data() + j0);
    if (activation == Activation::kTanh) acc = rational_tanh(acc);
    if (activation == Activation::kRelu) acc = acc > zero ? acc : zero;
    *reinterpret_cast<Lanes*>(out + j0) = acc;
  }
}

class DenseNet {
 public:
  DenseNet(const std::vector<FloatArray>& weights, const std::vector<FloatArray>& biases,
           const std::string& activation) {
    if (weights.empty() || weights.size() != biases.size()) {
      throw std::invalid_argument("a dense network needs one bias per weight matrix, and at least one layer");
    }
    if (activation != "tanh" && activation != "relu") {
      throw std::invalid_argument("activation must be 'tanh' or 'relu', got '" + activation + "'");
    }
    tanh_ = activation == "tanh";
    size_t widest = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      const FloatArray& w = weights[i];
      const FloatArray& b = biases[i];
      if (w.ndim() != 2 || b.ndim() != 1 || b.shape(0) != w.shape(0)) {
        throw std::invalid_argument("layer " + std::to_string(i) + ": weight must be [out, in] and bias [out]");
      }
      Layer layer{static_cast<size_t>(w.shape(1)), static_cast<size_t>(w.shape(0)), {}, {}};
      if (i && layer.in != layers_.back().out) {
        throw std::invalid_argument("layer " + std::to_string(i) + " takes " + std::to_string(layer.in) +
                                    " inputs, the previous layer gives " + std::to_string(layers_.back().out));
      }
      const size_t blocks = (layer.out + kBlock - 1) / kBlock;
      layer.weight.assign(blocks * layer.in * kBlock, 0.0f);
      for (size_t j = 0; j < layer.out; ++j) {
        for (size_t c = 0; c < layer.in; ++c) {
          layer.weight[(j / kBlock * layer.in + c) * kBlock + j % kBlock] = w.data()[j * layer.in + c];
        }
      }
      layer.bias.assign(blocks * kBlock, 0.0f);
      std::copy(b.data(), b.data() + layer.out, layer.bias.begin());
      widest = std::max(widest, std::max(layer.in, layer.out));
      layers_.push_back(std::move(layer));
    }
    a_.resize(widest + kBlock);
    b_.resize(widest + kBlock);
  }

  size_t num_inputs() const { return layers_.front().in; }
  size_t num_outputs() const { return layers_.back().out; }

  // The index of the largest output for one input row (the lowest on ties); -1 if an output is not finite.
  int act(const FloatArray& x) {
    check_row(x);
    const float* out = forward(x.data());
    int best = 0;
    for (size_t j = 0; j < num_outputs(); ++j) {
      if (!std::isfinite(out[j])) return -1;
      if (out[j] > out[best]) best = static_cast<int>(j);
    }
    return best;
  }

  // Outputs [N, num_outputs] for input rows [N, num_inputs].
  py::array_t<float> outputs(const FloatArray& x) {
    if (x.ndim() != 2 || static_cast<size_t>(x.shape(1)) != num_inputs()) {
      throw std::invalid_argument("inputs must be [N, " + std::to_string(num_inputs()) + "]");
    }
    const size_t rows = static_cast<size_t>(x.shape(0));
    py::array_t<float> result({rows, num_outputs()});
    float* dst = result.mutable_data();
    for (size_t r = 0; r < rows; ++r) {
      const float* out = forward(x.data() + r * num_inputs());
      std::copy(out, out + num_outputs(), dst + r * num_outputs());
    }
    return result;
  }

 private:
  std::vector<Layer> layers_;
  std::vector<float> a_, b_;
  bool tanh_ = true;

  void check_row(const FloatArray& x) const {
    if (static_cast<size_t>(x.size()) != num_inputs()) {
      throw std::invalid_argument("input has " + std::to_string(x.size()) + " values, the network takes " +
                                  std::to_string(num_inputs()));
    }
  }

  const float* forward(const float* input) {
    const float* in = input;
    float* out = a_.data();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      apply_layer(layer, in, out, i + 1 == layers_.size() ? Activation::kNone
                                  : tanh_ ? Activation::kTanh : Activation::kRelu);
      in = out;
      out = out == a_.data() ? b_.data() : a_.data();
    }
    return in;
  }
};

}  // namespace

PYBIND11_MODULE(_dense, m) {
  m.doc() = "A dense network evaluated in place (see feather_gym.policy_runtime).";
  py::class_<DenseNet>(m, "DenseNet")
      .def(py::init<const std::vector<FloatArray>&, const std::vector<FloatArray>&, const std::string&>(),
           py::arg("weights"), py::arg("biases"), py::arg("activation"))
      .def_property_readonly("num_inputs", &DenseNet::num_inputs)
      .def_property_readonly("num_outputs", &DenseNet::num_outputs)
      .def("act", &DenseNet::act)
      .def("outputs", &DenseNet::outputs);
}
