// A probe, not part of the product: cuDNN's DgradDreluBNBwdWeight fusion (the cuDNN frontend's
// C++ graph API; its Python API lacks the dbn_weight node), for bench/fused_bottleneck.py.
//
// One graph: da = conv_dgrad(dy, w); dz = da * (relu'(bn(x))), with bn(x) = (x - mean) * invstd *
// gamma + beta recomputed in the epilogue; dz written (fp16); and the BN backward's per-channel
// terms from dz and x in the same pass: dgamma, dbeta and the "equivalent" scales with which
// the BN input's gradient is dx = eq_dy * dz + eq_x * x + eq_bias (applied by the caller).
//
// Tensors are torch's: fp16 NHWC activations and KRSC weights, fp32 (1, C, 1, 1) statistics.
// The stream comes from Python (torch.cuda.current_stream().cuda_stream).
#include <torch/extension.h>

#include <cudnn_frontend.h>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

namespace {

cudnnHandle_t handle() {
    static cudnnHandle_t made = nullptr;
    if (made == nullptr) {
        TORCH_CHECK(cudnnCreate(&made) == CUDNN_STATUS_SUCCESS, "cudnnCreate failed");
    }
    return made;
}

std::vector<int64_t> nhwc_stride(const std::vector<int64_t>& d) {  // d: N, C, H, W
    return {d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]};
}

std::vector<int64_t> dims(const torch::Tensor& t) { return t.sizes().vec(); }

struct Plan {
    std::shared_ptr<fe::graph::Graph> graph;
    TensorPtr dy, w, x, mean, invstd, gamma, beta, dz, dgamma, dbeta, eq_dy, eq_x, eq_bias;
    int64_t workspace = 0;
    std::string refused;  // empty: built
};

TensorPtr activation(fe::graph::Graph& g, const char* name, const std::vector<int64_t>& d) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim(d).set_stride(nhwc_stride(d))
                        .set_data_type(fe::DataType_t::HALF));
}

TensorPtr channel(fe::graph::Graph& g, const char* name, int64_t c) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim({1, c, 1, 1}).set_stride({c, 1, c, c})
                        .set_data_type(fe::DataType_t::FLOAT));
}

std::unique_ptr<Plan> build(const std::vector<int64_t>& dy_d, const std::vector<int64_t>& w_d,
                            const std::vector<int64_t>& x_d, int64_t stride, int64_t pad) {
    auto plan = std::make_unique<Plan>();
    plan->graph = std::make_shared<fe::graph::Graph>();
    auto& g = *plan->graph;
    g.set_io_data_type(fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const int64_t c = x_d[1];
    plan->dy = activation(g, "dy", dy_d);
    plan->w = activation(g, "w", w_d);  // K, C, R, S with KRSC strides: the same formula
    auto options = fe::graph::Conv_dgrad_attributes().set_padding({pad, pad}).set_stride({stride, stride})
                       .set_dilation({1, 1});
    auto da = g.conv_dgrad(plan->dy, plan->w, options);
    da->set_dim(x_d).set_stride(nhwc_stride(x_d));
    plan->x = activation(g, "x", x_d);
    plan->mean = channel(g, "mean", c);
    plan->invstd = channel(g, "invstd", c);
    plan->gamma = channel(g, "gamma", c);
    plan->beta = channel(g, "beta", c);
    using Mode = fe::PointwiseMode_t;
    auto pw = [&g](TensorPtr a, TensorPtr b, Mode mode) {
        return g.pointwise(a, b, fe::graph::Pointwise_attributes().set_mode(mode));
    };
    auto bn = pw(pw(pw(pw(plan->x, plan->mean, Mode::SUB), plan->invstd, Mode::MUL), plan->gamma, Mode::MUL),
                 plan->beta, Mode::ADD);
    plan->dz = pw(da, bn, Mode::RELU_BWD);
    plan->dz->set_output(true).set_dim(x_d).set_stride(nhwc_stride(x_d)).set_data_type(fe::DataType_t::HALF);
    auto outs = g.dbn_weight(plan->dz, plan->x, plan->mean, plan->invstd, plan->gamma,
                             fe::graph::DBN_weight_attributes());
    plan->dgamma = outs[0];
    plan->dbeta = outs[1];
    plan->eq_dy = outs[2];
    plan->eq_x = outs[3];
    plan->eq_bias = outs[4];
    for (auto& t : outs) t->set_output(true).set_data_type(fe::DataType_t::FLOAT);

    auto step = [&plan](fe::error_t status, const char* what) {
        if (!status.is_good() && plan->refused.empty()) plan->refused = std::string(what) + ": " + status.get_message();
        return status.is_good();
    };
    step(g.validate(), "validate") && step(g.build_operation_graph(handle()), "build_operation_graph") &&
        step(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans") &&
        step(g.check_support(), "check_support") && step(g.build_plans(), "build_plans") &&
        step(g.get_workspace_size(plan->workspace), "get_workspace_size");
    return plan;
}

std::map<std::string, std::unique_ptr<Plan>>& plans() {
    static std::map<std::string, std::unique_ptr<Plan>> cached;
    return cached;
}

Plan& plan_for(const torch::Tensor& dy, const torch::Tensor& w, const torch::Tensor& x, int64_t stride, int64_t pad) {
    std::ostringstream key;
    for (auto v : dims(dy)) key << v << ',';
    key << '|';
    for (auto v : dims(w)) key << v << ',';
    key << '|';
    for (auto v : dims(x)) key << v << ',';
    key << '|' << stride << ',' << pad;
    auto& slot = plans()[key.str()];
    if (!slot) slot = build(dims(dy), dims(w), dims(x), stride, pad);
    return *slot;
}

void check_nhwc_half(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kHalf && t.dim() == 4 &&
                    t.is_contiguous(at::MemoryFormat::ChannelsLast),
                name, ": a CUDA fp16 channels_last 4-d tensor is needed");
}

}  // namespace

// "" where cuDNN builds the graph for these shapes, else why not (the caller falls back).
std::string refused(torch::Tensor dy, torch::Tensor w, torch::Tensor x, int64_t stride, int64_t pad) {
    return plan_for(dy, w, x, stride, pad).refused;
}

// (dz, dgamma, dbeta, eq_dy, eq_x, eq_bias); dz fp16 NHWC, the rest fp32 (1, C, 1, 1).
std::vector<torch::Tensor> dgrad_drelu_dbn(torch::Tensor dy, torch::Tensor w, torch::Tensor x, torch::Tensor mean,
                                           torch::Tensor invstd, torch::Tensor gamma, torch::Tensor beta,
                                           int64_t stride, int64_t pad, int64_t stream) {
    check_nhwc_half(dy, "dy");
    check_nhwc_half(w, "w");
    check_nhwc_half(x, "x");
    Plan& plan = plan_for(dy, w, x, stride, pad);
    TORCH_CHECK(plan.refused.empty(), "cuDNN refused DgradDreluBNBwdWeight for these shapes: ", plan.refused);
    const int64_t c = x.size(1);
    auto per_channel = [&](const torch::Tensor& t) {
        return t.to(torch::kFloat).reshape({1, c, 1, 1}).contiguous();
    };
    auto m = per_channel(mean), v = per_channel(invstd), s = per_channel(gamma), b = per_channel(beta);
    auto dz = torch::empty_like(x, x.options(), at::MemoryFormat::ChannelsLast);
    auto f32 = x.options().dtype(torch::kFloat);
    std::vector<torch::Tensor> terms;
    for (int i = 0; i < 5; ++i) terms.push_back(torch::empty({1, c, 1, 1}, f32));
    auto workspace = torch::empty({std::max<int64_t>(plan.workspace, 1)}, x.options().dtype(torch::kByte));
    std::unordered_map<TensorPtr, void*> pack = {
        {plan.dy, dy.data_ptr()},        {plan.w, w.data_ptr()},           {plan.x, x.data_ptr()},
        {plan.mean, m.data_ptr()},       {plan.invstd, v.data_ptr()},      {plan.gamma, s.data_ptr()},
        {plan.beta, b.data_ptr()},       {plan.dz, dz.data_ptr()},         {plan.dgamma, terms[0].data_ptr()},
        {plan.dbeta, terms[1].data_ptr()}, {plan.eq_dy, terms[2].data_ptr()}, {plan.eq_x, terms[3].data_ptr()},
        {plan.eq_bias, terms[4].data_ptr()}};
    TORCH_CHECK(cudnnSetStream(handle(), reinterpret_cast<cudaStream_t>(stream)) == CUDNN_STATUS_SUCCESS,
                "cudnnSetStream failed");
    auto status = plan.graph->execute(handle(), pack, workspace.data_ptr());
    TORCH_CHECK(status.is_good(), "DgradDreluBNBwdWeight failed to run: ", status.get_message());
    return {dz, terms[0], terms[1], terms[2], terms[3], terms[4]};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("refused", &refused, "why cuDNN will not build the graph for these shapes ('' if it will)");
    m.def("dgrad_drelu_dbn", &dgrad_drelu_dbn, "dgrad + relu backward + BN backward weight terms, one graph");
    m.def("backend_version", []() { return static_cast<int64_t>(cudnnGetVersion()); });
}
