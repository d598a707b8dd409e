"""The runtime: NVRTC compilation and its cache (compiler), the device (device) and kernel launches
(launcher). Knows kernels only as objects with a source file, a template name, compile options, a
thread count and a shared-memory size; nothing here knows attention."""
