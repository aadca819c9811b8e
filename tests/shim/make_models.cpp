/*
 * Builds the TorchScript test models from source (no binary blobs in the repository) and saves
 * them into the directory given as the only argument:
 *   mlp.pt      x [N,8] -> [N,4]: fc2(relu(fc1(x))) * out_scale (submodules fc1, fc2; a buffer)
 *   dict.pt     {x: [N,16], y: [N,16]} -> {output: [N,1], sum: [N,16]} (Torch Spread's example)
 *   raising.pt  x -> 2x, raising an error when x has a negative value
 *   identity.pt Dict[str, Tensor] -> the same dict
 *   listy.pt    List[Tensor] -> (x0 + x1, [2 x0], len, 1.5, "ok", True)
 *   keeper.pt   x -> x + 1, keeping x in an attribute until the next call
 */
#include <torch/script.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace
{

torch::jit::Module linear(const std::string &cls, int64_t in, int64_t out)
{
    torch::jit::Module m(c10::QualifiedName("__torch__." + cls));
    m.register_parameter("weight", torch::randn({out, in}) / std::sqrt(static_cast<double>(in)),
                         false);
    m.register_parameter("bias", torch::randn({out}) * 0.1, false);
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    return torch.addmm(self.bias, x, self.weight.t())
)JIT");
    return m;
}

torch::jit::Module mlp()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.MLP"));
    m.register_module("fc1", linear("Linear8x32", 8, 32));
    m.register_module("fc2", linear("Linear32x4", 32, 4));
    m.register_buffer("out_scale", torch::ones({4}));
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    return self.fc2.forward(torch.relu(self.fc1.forward(x))) * self.out_scale
)JIT");
    return m;
}

torch::jit::Module dict_model()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.SmallNetwork"));
    m.register_module("linear", linear("Linear16x1", 16, 1));
    m.define(R"JIT(
def forward(self, inp: Dict[str, Tensor]) -> Dict[str, Tensor]:
    x = inp["x"]
    y = inp["y"]
    return {"output": self.linear.forward(x), "sum": x + y}
)JIT");
    return m;
}

torch::jit::Module raising()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Raising"));
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    assert not bool((x < 0).any()), "negative input"
    return x * 2.0
)JIT");
    return m;
}

torch::jit::Module identity()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Identity"));
    m.define(R"JIT(
def forward(self, inp: Dict[str, Tensor]) -> Dict[str, Tensor]:
    return inp
)JIT");
    return m;
}

torch::jit::Module listy()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Listy"));
    m.define(R"JIT(
def forward(self, xs: List[Tensor]) -> Tuple[Tensor, List[Tensor], int, float, str, bool]:
    return (xs[0] + xs[1], [xs[0] * 2], len(xs), 1.5, "ok", True)
)JIT");
    return m;
}

torch::jit::Module keeper()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Keeper"));
    m.register_attribute("last", c10::TensorType::get(), torch::zeros({1}));
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    self.last = x
    return x + 1
)JIT");
    return m;
}

} // namespace

int main(int argc, char **argv)
{
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    std::string dir = argv[1];
    try {
        std::filesystem::create_directories(dir); /* docs/BATCHER.md names a fresh directory */
        torch::manual_seed(0);
        mlp().save(dir + "/mlp.pt");
        dict_model().save(dir + "/dict.pt");
        raising().save(dir + "/raising.pt");
        identity().save(dir + "/identity.pt");
        listy().save(dir + "/listy.pt");
        keeper().save(dir + "/keeper.pt");
    } catch (const c10::Error &e) {
        std::fprintf(stderr, "make_models: %s\n", e.what_without_backtrace());
        return 1;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "make_models: %s\n", e.what());
        return 1;
    }
    std::printf("models written to %s\n", dir.c_str());
    return 0;
}
