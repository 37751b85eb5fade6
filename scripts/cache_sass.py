#!/usr/bin/env python3
"""Disassembles cached cubins: for every entry of a kiln disk cache whose spec contains TEXT,
writes its image to OUTDIR/<spec>.cubin and prints the count of each SASS opcode in PATTERNS
(cuobjdump --dump-sass). Usage: scripts/cache_sass.py CACHE_DIR TEXT OUTDIR [PATTERN ...]
(default pattern HGMMA). The entry format is described in cache-layout.md."""
import pathlib, re, struct, subprocess, sys

def read_entry(data):
    pos = 8 + 4 + 32  # magic, format, key
    def take_str():
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        s = data[pos:pos + n]
        pos += n
        return s
    def take_list():
        nonlocal pos
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        return [take_str() for _ in range(n)]
    spec = take_str().decode()
    for _ in range(5):  # producer, image kind, target, nvrtc version, source
        take_str()
    (headers,) = struct.unpack_from("<I", data, pos)
    pos += 4
    for _ in range(2 * headers):
        take_str()
    take_list(); take_list(); take_list()  # name expressions, lowered names, options
    return spec, take_str()

def main():
    root, text, out = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
    patterns = sys.argv[4:] or ["HGMMA"]
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.read_bytes()[:8] != b"KILNJIT\0":
            continue
        spec, image = read_entry(path.read_bytes())
        if text not in spec or image[:4] != b"\x7fELF":
            continue
        cubin = out / (re.sub(r"[^A-Za-z0-9=_.-]+", "_", spec) + ".cubin")
        cubin.write_bytes(image)
        sass = subprocess.run(["cuobjdump", "--dump-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
        counts = ", ".join(f"{p} {len(re.findall(p, sass))}" for p in patterns)
        print(f"{spec}: {counts}")

if __name__ == "__main__":
    main()
