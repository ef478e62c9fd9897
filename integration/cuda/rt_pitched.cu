// Pitched copies: cudaMemcpy2D / 2DAsync and cudaMemcpy3D / 3DAsync between
// host and pitched device memory, every direction, with offsets into both
// sides; the bytes between rows stay as they were; hostile pitches and
// offsets (and a 2-D memset's) are errors that change nothing. The same copies
// captured from a stream and added to graphs as memcpy nodes, replayed with new
// host data.
#include <cuda_runtime.h>
#include <vector>
#include "check.h"

// Host image of a pitched buffer: `rows` rows of `pitch` bytes.
struct Image {
    size_t pitch, rows;
    std::vector<unsigned char> b;
    Image(size_t pitch, size_t rows, uint32_t seed) : pitch(pitch), rows(rows), b(pitch * rows) { fill_pattern(b.data(), b.size(), seed); }
};

// Expected contents after copying a w x h block from `src` (at sx, sy) into
// `dst` (at dx, dy): dst unchanged elsewhere.
static void expect_block(const Image &got, const Image &before, const Image &src, size_t sx, size_t sy, size_t dx, size_t dy,
                         size_t w, size_t h, const char *what) {
    for (size_t r = 0; r < got.rows; r++)
        for (size_t c = 0; c < got.pitch; c++) {
            bool in = r >= dy && r < dy + h && c >= dx && c < dx + w;
            unsigned char want = in ? src.b[(sy + r - dy) * src.pitch + sx + c - dx] : before.b[r * got.pitch + c];
            EXPECT(got.b[r * got.pitch + c] == want, "%s: row %zu col %zu is 0x%02x, expected 0x%02x (%s)", what, r, c,
                   got.b[r * got.pitch + c], want, in ? "copied" : "untouched");
        }
}

static void expect_failed(cudaError_t e, const char *what) {
    EXPECT(e != cudaSuccess, "%s succeeded", what);
    cudaGetLastError();
}

int main() {
    test_begin("rt_pitched");
    const size_t W = 300, H = 40;  // the device buffer's logical size
    unsigned char *d = nullptr;
    size_t dpitch = 0;
    CHECK(cudaMallocPitch((void **)&d, &dpitch, W, H));
    EXPECT(dpitch >= W, "pitch %zu under the width %zu", dpitch, W);

    // Known contents on the device: the whole pitched span, one plain copy.
    Image dev(dpitch, H, 1);
    CHECK(cudaMemcpy(d, dev.b.data(), dev.b.size(), cudaMemcpyHostToDevice));

    // H2D: a 77 x 13 block from a host image with pitch 500 at (5, 3) to (20, 7).
    Image host(500, 30, 2);
    CHECK(cudaMemcpy2D(d + 7 * dpitch + 20, dpitch, host.b.data() + 3 * 500 + 5, 500, 77, 13, cudaMemcpyHostToDevice));
    Image got(dpitch, H, 0);
    CHECK(cudaMemcpy(got.b.data(), d, got.b.size(), cudaMemcpyDeviceToHost));
    expect_block(got, dev, host, 5, 3, 20, 7, 77, 13, "cudaMemcpy2D H2D");
    dev = got;
    ok("cudaMemcpy2D host (pitch 500) to device (pitch %zu): a 77 x 13 block at an offset, the rest untouched", dpitch);

    // D2H: a 120 x 9 block from (31, 2) into a host image with pitch 256 at (10, 4).
    Image out(256, 20, 3), out_before = out;
    CHECK(cudaMemcpy2D(out.b.data() + 4 * 256 + 10, 256, d + 2 * dpitch + 31, dpitch, 120, 9, cudaMemcpyDeviceToHost));
    expect_block(out, out_before, dev, 31, 2, 10, 4, 120, 9, "cudaMemcpy2D D2H");
    ok("cudaMemcpy2D device to host (pitch 256), the host rows between untouched");

    // D2D: within one pitched buffer into another with a different pitch.
    unsigned char *e = nullptr;
    size_t epitch = 0;
    CHECK(cudaMallocPitch((void **)&e, &epitch, 1000, 8));
    Image e_img(epitch, 8, 4);
    CHECK(cudaMemcpy(e, e_img.b.data(), e_img.b.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy2D(e + 1 * epitch + 600, epitch, d + 10 * dpitch + 3, dpitch, 250, 6, cudaMemcpyDeviceToDevice));
    Image e_got(epitch, 8, 0);
    CHECK(cudaMemcpy(e_got.b.data(), e, e_got.b.size(), cudaMemcpyDeviceToHost));
    expect_block(e_got, e_img, dev, 3, 10, 600, 1, 250, 6, "cudaMemcpy2D D2D");
    ok("cudaMemcpy2D device to device between pitches %zu and %zu", dpitch, epitch);

    // Dense rows on both sides (pitch == width) and cudaMemcpyDefault.
    std::vector<unsigned char> dense(64 * 10), back(64 * 10);
    fill_pattern(dense.data(), dense.size(), 5);
    unsigned char *f = nullptr;
    CHECK(cudaMalloc((void **)&f, dense.size()));
    CHECK(cudaMemcpy2D(f, 64, dense.data(), 64, 64, 10, cudaMemcpyDefault));
    CHECK(cudaMemcpy2D(back.data(), 64, f, 64, 64, 10, cudaMemcpyDefault));
    EXPECT(check_pattern(back.data(), back.size(), 5) < 0, "dense 2D round trip wrong");
    ok("cudaMemcpy2D with back-to-back rows and cudaMemcpyDefault");

    // A pitch much wider than the rows (read row by row) and a host-to-host copy.
    Image wide(4096, 6, 6);
    unsigned char *g = nullptr;
    CHECK(cudaMalloc((void **)&g, 4096 * 6));
    CHECK(cudaMemcpy(g, wide.b.data(), wide.b.size(), cudaMemcpyHostToDevice));
    Image narrow(16, 6, 7), narrow_before = narrow;
    CHECK(cudaMemcpy2D(narrow.b.data() + 2, 16, g + 100, 4096, 12, 6, cudaMemcpyDeviceToHost));
    expect_block(narrow, narrow_before, wide, 100, 0, 2, 0, 12, 6, "cudaMemcpy2D D2H, wide pitch");
    Image hh(32, 4, 8), hh_before = hh;
    CHECK(cudaMemcpy2D(hh.b.data() + 32 + 1, 32, wide.b.data() + 4096 + 7, 4096, 20, 3, cudaMemcpyHostToHost));
    expect_block(hh, hh_before, wide, 7, 1, 1, 1, 20, 3, "cudaMemcpy2D H2H");
    ok("cudaMemcpy2D from a pitch 256 times the width, and host to host");

    // Async on a stream, ordered with a kernel-free 1-D copy after it.
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    Image src2(400, 16, 9);
    CHECK(cudaMemcpy2DAsync(d, dpitch, src2.b.data(), 400, 300, 16, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpyAsync(got.b.data(), d, got.b.size(), cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    expect_block(got, dev, src2, 0, 0, 0, 0, 300, 16, "cudaMemcpy2DAsync H2D");
    dev = got;
    Image out2(310, 16, 10), out2_before = out2;
    CHECK(cudaMemcpy2DAsync(out2.b.data(), 310, d, dpitch, 300, 16, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    expect_block(out2, out2_before, dev, 0, 0, 0, 0, 300, 16, "cudaMemcpy2DAsync D2H");
    ok("cudaMemcpy2DAsync both ways on a stream");

    // 3-D: a 40 x 5 x 3 box between a cudaMalloc3D volume and a host volume.
    cudaExtent ext = make_cudaExtent(64, 8, 4);
    cudaPitchedPtr vol;
    CHECK(cudaMalloc3D(&vol, ext));
    size_t vbytes = vol.pitch * 8 * 4;
    Image vdev(vol.pitch, 8 * 4, 11);
    CHECK(cudaMemcpy(vol.ptr, vdev.b.data(), vbytes, cudaMemcpyHostToDevice));
    Image hvol(100, 10 * 5, 12);  // 5 slices of 10 rows of 100 bytes
    cudaMemcpy3DParms p = {};
    p.srcPtr = make_cudaPitchedPtr(hvol.b.data(), 100, 100, 10);
    p.srcPos = make_cudaPos(7, 2, 1);
    p.dstPtr = vol;
    p.dstPos = make_cudaPos(11, 1, 1);
    p.extent = make_cudaExtent(40, 5, 3);
    p.kind = cudaMemcpyHostToDevice;
    CHECK(cudaMemcpy3D(&p));
    Image vgot(vol.pitch, 8 * 4, 0);
    CHECK(cudaMemcpy(vgot.b.data(), vol.ptr, vbytes, cudaMemcpyDeviceToHost));
    for (size_t z = 0; z < 4; z++)
        for (size_t y = 0; y < 8; y++)
            for (size_t x = 0; x < vol.pitch; x++) {
                bool in = z >= 1 && z < 4 && y >= 1 && y < 6 && x >= 11 && x < 51;
                size_t at = (z * 8 + y) * vol.pitch + x;
                unsigned char want = in ? hvol.b[((z - 1 + 1) * 10 + (y - 1 + 2)) * 100 + (x - 11 + 7)] : vdev.b[at];
                EXPECT(vgot.b[at] == want, "cudaMemcpy3D H2D: (%zu, %zu, %zu) is 0x%02x, expected 0x%02x", x, y, z, vgot.b[at], want);
            }
    ok("cudaMemcpy3D host to a cudaMalloc3D volume (pitch %zu): a 40 x 5 x 3 box at offsets", vol.pitch);

    Image hback(50, 6 * 4, 13), hback_before = hback;  // 4 slices of 6 rows of 50 bytes
    cudaMemcpy3DParms q = {};
    q.srcPtr = vol;
    q.srcPos = make_cudaPos(11, 1, 1);
    q.dstPtr = make_cudaPitchedPtr(hback.b.data(), 50, 50, 6);
    q.dstPos = make_cudaPos(3, 0, 0);
    q.extent = make_cudaExtent(40, 5, 3);
    q.kind = cudaMemcpyDeviceToHost;
    CHECK(cudaMemcpy3DAsync(&q, s));
    CHECK(cudaStreamSynchronize(s));
    for (size_t z = 0; z < 4; z++)
        for (size_t y = 0; y < 6; y++)
            for (size_t x = 0; x < 50; x++) {
                bool in = z < 3 && y < 5 && x >= 3 && x < 43;
                size_t at = (z * 6 + y) * 50 + x;
                unsigned char want = in ? vgot.b[((z + 1) * 8 + y + 1) * vol.pitch + x - 3 + 11] : hback_before.b[at];
                EXPECT(hback.b[at] == want, "cudaMemcpy3DAsync D2H: (%zu, %zu, %zu) is 0x%02x, expected 0x%02x", x, y, z, hback.b[at], want);
            }
    ok("cudaMemcpy3DAsync from the volume back to a host volume of other pitch and height");

    // Hostile parameters: errors, and nothing written.
    CHECK(cudaMemcpy(got.b.data(), d, got.b.size(), cudaMemcpyDeviceToHost));
    dev = got;
    std::vector<unsigned char> vsaved = vgot.b;
    Image tiny(16, 4, 14), tiny_before = tiny;
    expect_failed(cudaMemcpy2D(d, dpitch, tiny.b.data(), 8, 16, 4, cudaMemcpyHostToDevice), "a source pitch under the width");
    expect_failed(cudaMemcpy2D(d, dpitch, tiny.b.data(), 16, 16, H + 1, cudaMemcpyHostToDevice), "rows past the allocation");
    expect_failed(cudaMemcpy2D(tiny.b.data(), 16, d, (size_t)1 << 62, 16, 4, cudaMemcpyDeviceToHost), "a pitch of 2^62 from the device");
    expect_failed(cudaMemcpy2D(tiny.b.data(), 16, d + dpitch * H - 8, dpitch, 16, 1, cudaMemcpyDeviceToHost), "a row that ends past the allocation");
    expect_failed(cudaMemcpy2D(d, (size_t)-1 / 2, tiny.b.data(), 16, 16, 3, cudaMemcpyHostToDevice), "a destination pitch that wraps");
    // A pitch whose product with the rows wraps to a few bytes: refused at once, not sent.
    expect_failed(cudaMemset2D(d, ((size_t)1 << 63) + 16, 0x5A, 16, 3), "a memset pitch that wraps");
    CHECK(cudaDeviceSynchronize());
    cudaMemcpy3DParms r = p;
    r.dstPos = make_cudaPos(0, 0, 2);  // slices 2..4 of a 4-slice volume
    expect_failed(cudaMemcpy3D(&r), "a 3-D box past the last slice");
    CHECK(cudaMemcpy(got.b.data(), d, got.b.size(), cudaMemcpyDeviceToHost));
    EXPECT(got.b == dev.b, "a refused copy changed device memory");
    EXPECT(tiny.b == tiny_before.b, "a refused copy changed host memory");
    CHECK(cudaMemcpy(vgot.b.data(), vol.ptr, vbytes, cudaMemcpyDeviceToHost));
    EXPECT(vgot.b == vsaved, "a refused 3-D copy changed the volume");
    ok("hostile pitches and offsets are errors and write nothing; the device still works");

    // ---- captured: 2-D host to device, then device to host; replayed twice ----
    Image csrc(400, 16, 20), cout(310, 16, 21);
    const Image cout_before = cout;
    cudaGraph_t cg;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemcpy2DAsync(d + dpitch + 3, dpitch, csrc.b.data() + 2 * 400 + 1, 400, 200, 12, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpy2DAsync(cout.b.data() + 310 + 5, 310, d + dpitch + 3, dpitch, 200, 12, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamEndCapture(s, &cg));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(cg, nullptr, &nodes));
    EXPECT(nodes == 2, "the capture made %zu nodes", nodes);
    cudaGraphNode_t cn[2];
    CHECK(cudaGraphGetNodes(cg, cn, &nodes));
    cudaMemcpy3DParms cp = {};
    CHECK(cudaGraphMemcpyNodeGetParams(cn[0], &cp));
    EXPECT(cp.extent.width == 200 && cp.extent.height == 12 && cp.extent.depth == 1 && cp.srcPtr.pitch == 400 &&
               cp.dstPtr.pitch == dpitch,
           "the captured 2-D copy reads back as %zu x %zu x %zu, pitches %zu and %zu", cp.extent.width, cp.extent.height,
           cp.extent.depth, cp.srcPtr.pitch, cp.dstPtr.pitch);
    cudaGraphExec_t ce;
    CHECK(cudaGraphInstantiate(&ce, cg, 0));
    CHECK(cudaMemcpy(got.b.data(), d, got.b.size(), cudaMemcpyDeviceToHost));
    for (uint32_t round = 0; round < 2; round++) {
        const Image before = got;
        fill_pattern(csrc.b.data(), csrc.b.size(), 30 + round);  // read when the graph runs
        CHECK(cudaGraphLaunch(ce, s));
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaMemcpy(got.b.data(), d, got.b.size(), cudaMemcpyDeviceToHost));
        expect_block(got, before, csrc, 1, 2, 3, 1, 200, 12, "captured cudaMemcpy2DAsync H2D");
        expect_block(cout, cout_before, got, 3, 1, 5, 1, 200, 12, "captured cudaMemcpy2DAsync D2H");
    }
    ok("cudaMemcpy2DAsync both ways captured as memcpy nodes with their rows, replayed twice with new host data");

    // ---- captured: 3-D device to device between volumes ----
    cudaPitchedPtr vol2;
    CHECK(cudaMalloc3D(&vol2, ext));
    CHECK(cudaMemset(vol2.ptr, 0, vol2.pitch * 8 * 4));
    cudaMemcpy3DParms t = {};
    t.srcPtr = vol;
    t.srcPos = make_cudaPos(11, 1, 1);
    t.dstPtr = vol2;
    t.dstPos = make_cudaPos(2, 0, 0);
    t.extent = make_cudaExtent(40, 5, 3);
    t.kind = cudaMemcpyDeviceToDevice;
    cudaGraph_t vg;
    cudaGraphExec_t ve;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemcpy3DAsync(&t, s));
    CHECK(cudaStreamEndCapture(s, &vg));
    CHECK(cudaGraphInstantiate(&ve, vg, 0));
    CHECK(cudaGraphLaunch(ve, s));
    CHECK(cudaStreamSynchronize(s));
    // vol2 holds the 40 x 5 x 3 box from vol's (11, 1, 1) at (2, 0, 0), zeros elsewhere.
    auto expect_box_in_vol2 = [&](const char *what) {
        Image v2(vol2.pitch, 8 * 4, 0);
        CHECK(cudaMemcpy(v2.b.data(), vol2.ptr, v2.b.size(), cudaMemcpyDeviceToHost));
        for (size_t z = 0; z < 4; z++)
            for (size_t y = 0; y < 8; y++)
                for (size_t x = 0; x < vol2.pitch; x++) {
                    bool in = z < 3 && y < 5 && x >= 2 && x < 42;
                    size_t at = (z * 8 + y) * vol2.pitch + x;
                    unsigned char want = in ? vsaved[((z + 1) * 8 + y + 1) * vol.pitch + x - 2 + 11] : 0;
                    EXPECT(v2.b[at] == want, "%s: (%zu, %zu, %zu) is 0x%02x, expected 0x%02x", what, x, y, z, v2.b[at], want);
                }
    };
    expect_box_in_vol2("captured cudaMemcpy3DAsync D2D");
    ok("cudaMemcpy3DAsync device to device captured and replayed: a 40 x 5 x 3 box between volumes");

    // The same box through cudaMemcpy3DPeer and cudaMemcpy3DPeerAsync (one device here).
    cudaMemcpy3DPeerParms pp = {};
    pp.srcPtr = vol;
    pp.srcPos = make_cudaPos(11, 1, 1);
    pp.srcDevice = 0;
    pp.dstPtr = vol2;
    pp.dstPos = make_cudaPos(2, 0, 0);
    pp.dstDevice = 0;
    pp.extent = make_cudaExtent(40, 5, 3);
    CHECK(cudaMemset(vol2.ptr, 0, vol2.pitch * 8 * 4));
    CHECK(cudaMemcpy3DPeer(&pp));
    expect_box_in_vol2("cudaMemcpy3DPeer");
    CHECK(cudaMemset(vol2.ptr, 0, vol2.pitch * 8 * 4));
    CHECK(cudaMemcpy3DPeerAsync(&pp, s));
    CHECK(cudaStreamSynchronize(s));
    expect_box_in_vol2("cudaMemcpy3DPeerAsync");
    cudaMemcpy3DPeerParms past = pp;
    past.dstPos = make_cudaPos(2, 0, 2);  // slices 2..4 of a 4-slice volume
    expect_failed(cudaMemcpy3DPeer(&past), "a 3-D peer box past the last slice");
    expect_box_in_vol2("after a refused cudaMemcpy3DPeer");
    ok("cudaMemcpy3DPeer and cudaMemcpy3DPeerAsync between volumes; one past the end refused, nothing written");

    // ---- a 3-D memcpy node added by hand: the volume to a host volume ----
    Image hb(50, 6 * 4, 40);
    const Image hb_before = hb;
    cudaMemcpy3DParms u = q;
    u.dstPtr = make_cudaPitchedPtr(hb.b.data(), 50, 50, 6);
    cudaGraph_t ng;
    cudaGraphNode_t node;
    cudaGraphExec_t ne;
    CHECK(cudaGraphCreate(&ng, 0));
    CHECK(cudaGraphAddMemcpyNode(&node, ng, nullptr, 0, &u));
    CHECK(cudaGraphMemcpyNodeGetParams(node, &cp));
    EXPECT(cp.extent.width == 40 && cp.extent.height == 5 && cp.extent.depth == 3 && cp.dstPtr.pitch == 50,
           "the 3-D node reads back as %zu x %zu x %zu, destination pitch %zu", cp.extent.width, cp.extent.height,
           cp.extent.depth, cp.dstPtr.pitch);
    CHECK(cudaGraphInstantiate(&ne, ng, 0));
    CHECK(cudaGraphLaunch(ne, s));
    CHECK(cudaStreamSynchronize(s));
    for (size_t z = 0; z < 4; z++)
        for (size_t y = 0; y < 6; y++)
            for (size_t x = 0; x < 50; x++) {
                bool in = z < 3 && y < 5 && x >= 3 && x < 43;
                size_t at = (z * 6 + y) * 50 + x;
                unsigned char want = in ? vsaved[((z + 1) * 8 + y + 1) * vol.pitch + x - 3 + 11] : hb_before.b[at];
                EXPECT(hb.b[at] == want, "3-D memcpy node D2H: (%zu, %zu, %zu) is 0x%02x, expected 0x%02x", x, y, z, hb.b[at], want);
            }
    ok("cudaGraphAddMemcpyNode with a 3-D box, device to a host volume");

    // ---- hostile shapes in a capture and in a node ----
    cudaGraph_t bad = nullptr;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    expect_failed(cudaMemcpy2DAsync(d, (size_t)-1 / 2, tiny.b.data(), 16, 16, 3, cudaMemcpyHostToDevice, s),
                  "a captured copy whose destination pitch wraps");
    CHECK_ERR(cudaStreamEndCapture(s, &bad), cudaErrorStreamCaptureInvalidated);
    EXPECT(bad == nullptr, "an invalidated capture gave a graph");
    cudaGetLastError();
    unsigned char *sparse = nullptr;
    const size_t many = (1 << 16) + 1;  // rows of one byte, two apart: one piece each
    CHECK(cudaMalloc((void **)&sparse, 2 * many));
    cudaMemcpy3DParms w = {};
    w.srcPtr = make_cudaPitchedPtr(sparse, 2, 1, many);
    std::vector<unsigned char> gathered(many);
    w.dstPtr = make_cudaPitchedPtr(gathered.data(), 1, 1, many);
    w.extent = make_cudaExtent(1, many, 1);
    w.kind = cudaMemcpyDeviceToHost;
    CHECK_ERR(cudaGraphAddMemcpyNode(&node, ng, nullptr, 0, &w), cudaErrorNotSupported);
    w.extent = make_cudaExtent(1, many - 1, 1);
    cudaGraphNode_t gather;
    CHECK(cudaGraphAddMemcpyNode(&gather, ng, nullptr, 0, &w));
    CHECK(cudaGraphDestroyNode(gather));
    CHECK(cudaFree(sparse));
    ok("a hostile captured copy invalidates the capture; a node of over 65,536 separate rows is refused as not supported");

    CHECK(cudaGraphExecDestroy(ce));
    CHECK(cudaGraphExecDestroy(ve));
    CHECK(cudaGraphExecDestroy(ne));
    CHECK(cudaGraphDestroy(cg));
    CHECK(cudaGraphDestroy(vg));
    CHECK(cudaGraphDestroy(ng));
    CHECK(cudaFree(vol2.ptr));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(d));
    CHECK(cudaFree(e));
    CHECK(cudaFree(f));
    CHECK(cudaFree(g));
    CHECK(cudaFree(vol.ptr));
    return test_end();
}
