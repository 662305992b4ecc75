//! Compiles the C++ shim (src/aten.cpp) against the PyTorch that is installed in the Python
//! environment doing the build, and links the module to that PyTorch's libraries.
//!
//! Design from the article ("Gemma 4 in Rust on TorchTPU: A Native TPU Rig With PyO3 and
//! MCP"): no tch, no libtorch download. The installed torch is asked for its headers, library
//! directory, C++ ABI flag and version; the shim is built with C++20 (PyTorch 2.14's headers
//! need it) and the versions are recorded for `gemma_engine.BUILD`.
//!
//! The shim's functions are listed once, in src/aten_ops.h (an X-macro list that aten.h expands into
//! the C prototypes); `write_extern_block` turns the same lines into the Rust `extern "C"` block that
//! src/ffi.rs includes from OUT_DIR.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// The Python that maturin builds for: PYO3_PYTHON, then the virtualenv's, then python3.
fn python() -> PathBuf {
    if let Some(p) = env::var_os("PYO3_PYTHON") {
        return PathBuf::from(p);
    }
    if let Some(venv) = env::var_os("VIRTUAL_ENV") {
        let p = PathBuf::from(venv).join("bin").join("python");
        if p.exists() {
            return p;
        }
    }
    PathBuf::from("python3")
}

/// What the installed torch says about itself, one value a line.
const PROBE: &str = r#"
import sys, sysconfig, torch
from torch.utils import cpp_extension as ce
print(torch.__version__)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print("\x1f".join(ce.include_paths()))
print(ce.library_paths()[0])
print(sysconfig.get_paths()["include"])
print("%d.%d.%d" % sys.version_info[:3])
# The CUDA headers the CUDA graph code needs (ATen/cuda/CUDAGraph.h includes cuda_runtime_api.h, which
# includes crt/host_config.h): from GEMMA_CUDA_INCLUDE (directories, os.pathsep-separated), the toolkit
# torch found, or the nvidia-* wheels. PyPI's CUDA torch installs the runtime's headers but not crt/
# (that comes with the compiler), so a plain .venv builds without CUDA graphs, as a torch without CUDA
# (CPU, TPU) does; empty means none.
cuda_include = []
if torch.version.cuda:
    import glob, os
    roots = [d for d in os.environ.get("GEMMA_CUDA_INCLUDE", "").split(os.pathsep) if d]
    if ce.CUDA_HOME:
        roots.append(os.path.join(ce.CUDA_HOME, "include"))
    try:
        import nvidia
        roots += [d for r in nvidia.__path__ for d in sorted(glob.glob(os.path.join(r, "*", "include")))]
    except ImportError:
        pass
    need = ("cuda_runtime_api.h", os.path.join("crt", "host_config.h"))
    found = [next((r for r in roots if os.path.exists(os.path.join(r, h))), None) for h in need]
    if all(found):
        cuda_include = list(dict.fromkeys(found))
print("\x1f".join(cuda_include))
"#;

fn main() {
    let py = python();
    let out = Command::new(&py)
        .args(["-c", PROBE])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} to ask torch for its build flags: {e}", py.display()));
    if !out.status.success() {
        panic!(
            "{} could not import torch (is it installed in this environment?):\n{}",
            py.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    let [torch_version, cxx11_abi, includes, lib_dir, py_include, py_version, cuda_include] = lines[..] else {
        panic!("unexpected answer from the torch probe:\n{text}");
    };

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("src/aten.cpp")
        .flag_if_supported("-std=c++20")
        .flag("-O2")
        .flag("-fPIC")
        // Torch's headers are noisy under -Wall; our own code is small.
        .flag_if_supported("-Wno-unused-parameter")
        .define("_GLIBCXX_USE_CXX11_ABI", cxx11_abi)
        .include("src")
        .include(py_include)
        .warnings(false);
    for inc in includes.split('\x1f') {
        build.include(inc);
    }
    let cuda_graphs = !cuda_include.is_empty();
    if cuda_graphs {
        build.define("GEMMA_CUDA_GRAPHS", None);
        for inc in cuda_include.split('\x1f') {
            build.include(inc);
        }
    }
    println!("cargo:rustc-env=GEMMA_BUILD_CUDA_GRAPHS={cuda_graphs}");
    build.compile("gemma_aten_shim");

    println!("cargo:rustc-link-search=native={lib_dir}");
    let cuda_libs: &[&str] = if cuda_graphs { &["torch_cuda", "c10_cuda"] } else { &[] };
    for lib in ["torch_python", "torch", "torch_cpu", "c10"].iter().chain(cuda_libs) {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    // The module is imported after `import torch`, which has already loaded these libraries;
    // the rpath makes the module loadable on its own too (and names the torch it was built for).
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");

    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "unknown".into());

    println!("cargo:rustc-env=GEMMA_BUILD_TORCH={torch_version}");
    println!("cargo:rustc-env=GEMMA_BUILD_RUSTC={rustc_version}");
    println!("cargo:rustc-env=GEMMA_BUILD_PYTHON={py_version}");

    write_build_py(torch_version);
    write_extern_block();

    println!("cargo:rerun-if-changed=src/aten.cpp");
    println!("cargo:rerun-if-changed=src/aten.h");
    println!("cargo:rerun-if-changed=src/aten_ops.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    println!("cargo:rerun-if-env-changed=GEMMA_CUDA_INCLUDE");
}

/// python/gemma_engine/_build.py tells the Python wrapper which torch this build needs before it
/// loads the native module (whose libtorch symbols may not resolve under another torch).
/// Generated, git-ignored; rewritten only when its content changes.
fn write_build_py(torch_version: &str) {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let path = manifest.join("python").join("gemma_engine").join("_build.py");
    let text = format!(
        "\"\"\"Generated by rust/build.rs: the torch this gemma_engine was built against.\"\"\"\n\nTORCH_VERSION = {torch_version:?}\n"
    );
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }
}

/// The Rust type of a C type in src/aten_ops.h (spaces removed), or None for one it does not know.
fn rust_type(c: &str) -> Option<&'static str> {
    Some(match c {
        "gt*" => "T",
        "gt**" => "*mut T",
        "gt*const*" => "*const T",
        "gg*" => "*mut CGraph",
        "PyObject*" => "*mut PyObject",
        "void*" => "*mut c_void",
        "constvoid*" => "*const c_void",
        "constchar*" => "*const c_char",
        "char*" => "*mut c_char",
        "int" => "c_int",
        "int64_t" => "i64",
        "int64_t*" => "*mut i64",
        "constint64_t*" => "*const i64",
        "size_t" => "usize",
        "double" => "f64",
        _ => return None,
    })
}

/// `X(ret, name, (params))` lines of src/aten_ops.h as Rust declarations, in the list's order.
fn extern_block(list: &str) -> Result<String, String> {
    // Comments out first: they may mention X( too.
    let mut text = String::new();
    let mut rest = list;
    while let Some(start) = rest.find("/*") {
        text.push_str(&rest[..start]);
        let end = rest[start..].find("*/").ok_or("an unclosed comment")?;
        rest = &rest[start + end + 2..];
    }
    text.push_str(rest);
    let mut out = String::from("unsafe extern \"C\" {\n");
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let inner = line
            .strip_prefix("X(")
            .and_then(|l| l.strip_suffix(')'))
            .ok_or_else(|| format!("not an X(ret, name, (params)) line: {line}"))?;
        let (ret, inner) = inner.split_once(',').ok_or_else(|| format!("no name: {line}"))?;
        let (name, params) = inner.split_once(',').ok_or_else(|| format!("no parameters: {line}"))?;
        let params = params
            .trim()
            .strip_prefix('(')
            .and_then(|p| p.strip_suffix(')'))
            .ok_or_else(|| format!("parameters not in parentheses: {line}"))?;
        let ty = |c: &str| {
            let key: String = c.chars().filter(|ch| !ch.is_whitespace()).collect();
            rust_type(&key).ok_or_else(|| format!("{}: a C type build.rs does not know: {c:?}", name.trim()))
        };
        let mut args = Vec::new();
        if params.trim() != "void" {
            for p in params.split(',') {
                let p = p.trim();
                let at = p.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                let (c, arg) = p.split_at(at);
                if arg.is_empty() || c.trim().is_empty() {
                    return Err(format!("{}: a parameter needs a type and a name: {p:?}", name.trim()));
                }
                args.push(format!("{arg}: {}", ty(c)?));
            }
        }
        let ret = match ret.trim() {
            "void" => String::new(),
            r => format!(" -> {}", ty(r)?),
        };
        out.push_str(&format!("    pub fn {}({}){ret};\n", name.trim(), args.join(", ")));
    }
    out.push_str("}\n");
    Ok(out)
}

/// OUT_DIR/aten_ops.rs: the Rust declarations of src/aten_ops.h (`include!`d by src/ffi.rs).
fn write_extern_block() {
    let list = std::fs::read_to_string("src/aten_ops.h").unwrap_or_else(|e| panic!("cannot read src/aten_ops.h: {e}"));
    let block = extern_block(&list).unwrap_or_else(|e| panic!("src/aten_ops.h: {e}"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("aten_ops.rs");
    std::fs::write(&out, block).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}
