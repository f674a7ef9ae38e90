// A probe, not part of the product: cuDNN's DgradDreluBNBwdWeight graph (the cuDNN frontend's C++
// API; its Python API lacks the dbn_weight node) as a plain C library for ctypes, so no torch
// headers, pybind or torch's build flags are involved. The graph is built exactly as the frontend's
// "Dgrad Drelu DBNweight Graph" sample builds it, which ran correctly as a standalone program.
//
//   dz = relu_bwd(conv_dgrad(dy, w), bn(x)),  bn(x) = (x - mean) * invstd * gamma + beta
//   (dgamma, dbeta, eq_dy, eq_x, eq_bias) = dbn_weight(dz, x, mean, invstd, gamma)
//   the BN input's gradient is then eq_dy * dz + eq_x * x + eq_bias (the caller's pass)
//
// Activations fp16 NHWC, weights fp16 KRSC, per-channel tensors fp32 (1, C, 1, 1).
#include <cudnn_frontend.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

namespace {

std::string last_error;

cudnnHandle_t handle() {
    static cudnnHandle_t made = nullptr;
    if (made == nullptr && cudnnCreate(&made) != CUDNN_STATUS_SUCCESS) made = nullptr;
    return made;
}

std::vector<int64_t> nhwc(int64_t n, int64_t c, int64_t h, int64_t w) { return {c * h * w, 1, w * c, c}; }

struct Plan {
    fe::graph::Graph graph;
    TensorPtr dy, w, x, mean, invstd, gamma, beta, dz, dgamma, dbeta, eq_dy, eq_x, eq_bias;
    int64_t workspace = 0;
};

std::vector<std::unique_ptr<Plan>> plans;
std::map<std::vector<int64_t>, int> index_of;

bool good(fe::error_t status, const char* stage) {
    if (status.is_good()) return true;
    last_error = std::string(stage) + ": " + status.get_message();
    return false;
}

}  // namespace

extern "C" {

int dd_version() { return static_cast<int>(cudnnGetVersion()); }

const char* dd_error() { return last_error.c_str(); }

// Builds (or finds) the plan for x (n, c, h, w), w (k, c, r, s), padding and stride. Returns its
// index, or -1 (dd_error says why). heur 0: heuristics A; 1: A and FALLBACK.
int dd_plan(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, int64_t r, int64_t s, int64_t pad,
            int64_t stride, int heur, int64_t* workspace) {
    std::vector<int64_t> key = {n, c, h, w, k, r, s, pad, stride, heur};
    auto found = index_of.find(key);
    if (found != index_of.end()) {
        *workspace = found->second >= 0 ? plans[found->second]->workspace : 0;
        return found->second;
    }
    index_of[key] = -1;
    cudnnHandle_t cudnn = handle();
    if (cudnn == nullptr) {
        last_error = "cudnnCreate failed";
        return -1;
    }
    const int64_t ho = (h + 2 * pad - r) / stride + 1, wo = (w + 2 * pad - s) / stride + 1;
    auto plan = std::make_unique<Plan>();
    auto& g = plan->graph;
    g.set_io_data_type(fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    plan->dy = g.tensor(fe::graph::Tensor_attributes().set_name("grad").set_dim({n, k, ho, wo})
                            .set_stride(nhwc(n, k, ho, wo)));
    plan->w = g.tensor(fe::graph::Tensor_attributes().set_name("weight").set_dim({k, c, r, s})
                           .set_stride(nhwc(k, c, r, s)));
    auto options = fe::graph::Conv_dgrad_attributes().set_padding({pad, pad}).set_stride({stride, stride})
                       .set_dilation({1, 1});
    auto da = g.conv_dgrad(plan->dy, plan->w, options);
    da->set_dim({n, c, h, w});
    plan->x = g.tensor(fe::graph::Tensor_attributes().set_name("image").set_dim({n, c, h, w})
                           .set_stride(nhwc(n, c, h, w)));
    auto channel = [&g, c](const char* name) {
        return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim({1, c, 1, 1})
                            .set_stride({c, 1, c, c}).set_data_type(fe::DataType_t::FLOAT));
    };
    plan->mean = channel("mean");
    plan->invstd = channel("invstd");
    plan->gamma = channel("gamma");
    plan->beta = channel("beta");
    auto pw = [&g](TensorPtr a, TensorPtr b, fe::PointwiseMode_t mode) {
        return g.pointwise(a, b, fe::graph::Pointwise_attributes().set_mode(mode));
    };
    auto bn = pw(pw(pw(pw(plan->x, plan->mean, fe::PointwiseMode_t::SUB), plan->invstd, fe::PointwiseMode_t::MUL),
                    plan->gamma, fe::PointwiseMode_t::MUL),
                 plan->beta, fe::PointwiseMode_t::ADD);
    plan->dz = pw(da, bn, fe::PointwiseMode_t::RELU_BWD);
    plan->dz->set_output(true);
    auto [dgamma, dbeta, eq_dy, eq_x, eq_bias] =
        g.dbn_weight(plan->dz, plan->x, plan->mean, plan->invstd, plan->gamma, fe::graph::DBN_weight_attributes());
    for (auto* t : {&dgamma, &dbeta, &eq_dy, &eq_x, &eq_bias}) (*t)->set_output(true);
    plan->dgamma = dgamma;
    plan->dbeta = dbeta;
    plan->eq_dy = eq_dy;
    plan->eq_x = eq_x;
    plan->eq_bias = eq_bias;
    std::vector<fe::HeurMode_t> modes = {fe::HeurMode_t::A};
    if (heur == 1) modes.push_back(fe::HeurMode_t::FALLBACK);
    if (!(good(g.validate(), "validate") && good(g.build_operation_graph(cudnn), "build_operation_graph") &&
          good(g.create_execution_plans(modes), "create_execution_plans") &&
          good(g.check_support(), "check_support") && good(g.build_plans(), "build_plans") &&
          good(g.get_workspace_size(plan->workspace), "get_workspace_size"))) {
        return -1;
    }
    *workspace = plan->workspace;
    plans.push_back(std::move(plan));
    index_of[key] = static_cast<int>(plans.size()) - 1;
    return index_of[key];
}

// Runs plan `index` on `stream`; 0 on success, else -1 (dd_error says why).
int dd_run(int index, void* dy, void* w, void* x, void* mean, void* invstd, void* gamma, void* beta, void* dz,
           void* dgamma, void* dbeta, void* eq_dy, void* eq_x, void* eq_bias, void* workspace, void* stream) {
    if (index < 0 || index >= static_cast<int>(plans.size())) {
        last_error = "no such plan";
        return -1;
    }
    Plan& p = *plans[index];
    if (cudnnSetStream(handle(), static_cast<cudaStream_t>(stream)) != CUDNN_STATUS_SUCCESS) {
        last_error = "cudnnSetStream failed";
        return -1;
    }
    std::unordered_map<TensorPtr, void*> pack = {
        {p.dy, dy},         {p.w, w},           {p.x, x},           {p.mean, mean},       {p.invstd, invstd},
        {p.gamma, gamma},   {p.beta, beta},     {p.dz, dz},         {p.dgamma, dgamma},   {p.dbeta, dbeta},
        {p.eq_dy, eq_dy},   {p.eq_x, eq_x},     {p.eq_bias, eq_bias}};
    return good(p.graph.execute(handle(), pack, workspace), "execute") ? 0 : -1;
}

}  // extern "C"
