//! `containerd-shim-crust-v2`: containerd runs it as `start`, as the
//! serving shim, and as `delete`.

fn main() {
    std::process::exit(crust_shim::bootstrap::main());
}
