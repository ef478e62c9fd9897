"""gpu-check: a small PyTorch workload whose numbers must not depend on
where the GPU is. Prints `torch <name> <value>` lines, then PASS torch.

Tensor creation, a matmul, and a short training loop of a small MLP on
fixed synthetic data (seeded, deterministic algorithms where PyTorch
offers them)."""
import time

import torch


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    a = torch.arange(1 << 20, dtype=torch.float32, device=dev).reshape(1024, 1024) / (1 << 20)
    b = torch.ones(1024, 1024, device=dev) * 0.5
    torch.cuda.synchronize()
    print(f"torch create_s {time.perf_counter() - t0:.4f}")
    t0 = time.perf_counter()
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
    print(f"torch matmul_s {time.perf_counter() - t0:.4f}")
    print(f"torch matmul_sum {c.double().sum().item():.9e}")

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 64, generator=g).to(dev)
    w_true = torch.randn(64, 10, generator=g).to(dev)
    y = (x @ w_true).argmax(dim=1)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for _ in range(200):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    print(f"torch train_s {time.perf_counter() - t0:.4f}")
    print(f"torch final_loss {loss.item():.6f}")
    acc = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"torch accuracy {acc:.4f}")
    print("PASS torch")


if __name__ == "__main__":
    main()
