//! The pre-decoded form a kernel runs in: one flat instruction array per
//! kernel (device functions inlined), operands resolved to register
//! indices or constants, addresses of symbols already known.

/// A source operand: a register (index into the warp's register file) or a
/// constant (immediates and symbol addresses, resolved at load time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    R(u32),
    C(u64),
}

/// Where a load or store goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// Device memory (`.global` and `.const`: module constants live in device memory).
    Global,
    /// The block's shared memory; addresses are offsets in it.
    Shared,
    /// The thread's local memory (stack, local arrays, call parameters).
    Local,
    /// The kernel's parameter buffer; addresses are offsets in it.
    KParam,
    /// A generic address: the windows below say which space it is in.
    Generic,
}

/// Generic-address windows for the non-global spaces. They sit below every
/// device address (the sim's start at 0x7f00_0000_0000) and below bit 48,
/// where the client's per-server pointer tag lives.
pub const SHARED_WINDOW: u64 = 0x0000_1000_0000_0000;
pub const LOCAL_WINDOW: u64 = 0x0000_2000_0000_0000;
pub const KPARAM_WINDOW: u64 = 0x0000_3000_0000_0000;
/// Size of each window.
pub const WINDOW_SIZE: u64 = 0x0000_1000_0000_0000;
/// Device address of a cooperative launch's grid-sync workspace (what a driver passes in
/// `%envreg1:%envreg2`): global memory of the launch itself, above the windows and below the
/// sim's virtual-memory window (0x5000_0000_0000) and device memory.
pub const GRID_SYNC_ADDR: u64 = 0x0000_4000_0000_0000;
/// Its size: `grid.sync()` uses the word at offset 4; the rest is zero, as a driver's is.
pub const GRID_SYNC_BYTES: u64 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum I2 {
    Add,
    Sub,
    AddSat,
    SubSat,
    MulLo,
    MulHi,
    /// Result twice as wide as the sources.
    MulWide,
    Mul24Lo,
    Div,
    Rem,
    Min,
    Max,
    /// `min`/`max` on `.s16x2`/`.u16x2`: each 16-bit half of a 32-bit register.
    MinX2,
    MaxX2,
    And,
    Or,
    Xor,
    Shl,
    Shr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum I1 {
    Neg,
    Abs,
    Not,
    /// `not.pred`/`cnot`: 0 -> 1, else 0.
    CNot,
    Popc,
    Clz,
    Brev,
    Bfind,
    BfindShift,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum I3 {
    MadLo,
    MadHi,
    MadWide,
    Mad24Lo,
    /// bfe a, pos, len.
    Bfe,
    /// prmt a, b, selector.
    Prmt,
    /// shf.{l,r}.{wrap,clamp}.b32 d, a (low), b (high), n.
    ShfLWrap,
    ShfLClamp,
    ShfRWrap,
    ShfRClamp,
    Sad,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FT {
    F16,
    BF16,
    F32,
    F64,
    F16x2,
    BF16x2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F2 {
    Add,
    Sub,
    Mul,
    Div,
    Min,
    Max,
    /// `min.NaN` / `max.NaN`: a NaN operand gives the canonical NaN instead of the other operand.
    MinNaN,
    MaxNaN,
    Copysign,
}

/// Carry-chain arithmetic: the carry flag (a borrow for subtraction) is read when `cc_in`
/// (`addc`, `subc`, `madc`) and written when `cc_out` (`.cc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CarryOp {
    Add,
    Sub,
    /// low half of a*b, plus c.
    MadLo,
    /// high half of a*b, plus c.
    MadHi,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FDir {
    Add,
    Sub,
    Mul,
    Div,
    Fma,
    Sqrt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F1 {
    Neg,
    Abs,
    Sqrt,
    Rsqrt,
    Rcp,
    Ex2,
    Lg2,
    Sin,
    Cos,
    Tanh,
    /// cvt.rni-style rounding within a float type (cvt.rni.f32.f32 etc.).
    RoundEven,
    Trunc,
    Floor,
    Ceil,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FMod {
    pub ftz: bool,
    pub sat: bool,
    /// `.relu` (f16/bf16 `fma`, `min`, `max`): negative results become +0, NaN the canonical NaN.
    pub relu: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

/// The operand type of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpTy {
    Int { bits: u8, signed: bool },
    Float(FT),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoolOp {
    And,
    Or,
    Xor,
}

/// Two values in one register: 16-bit halves, or bytes of a 16-bit value for the 8-bit formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packed {
    F16x2,
    BF16x2,
    E4m3x2,
    E5m2x2,
}

/// A scalar type as `cvt` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CvtTy {
    Int { bits: u8, signed: bool },
    Float(FT),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rnd {
    /// No rounding modifier.
    None,
    Rn,
    Rz,
    Rm,
    Rp,
    Rni,
    Rzi,
    Rmi,
    Rpi,
    Rna,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomOp {
    Add,
    Min,
    Max,
    Inc,
    Dec,
    And,
    Or,
    Xor,
    Exch,
    Cas,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomTy {
    U32,
    S32,
    U64,
    S64,
    F32,
    F64,
    B32,
    B64,
}

impl AtomTy {
    pub fn size(self) -> u8 {
        match self {
            AtomTy::U32 | AtomTy::S32 | AtomTy::F32 | AtomTy::B32 => 4,
            _ => 8,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShflMode {
    Up,
    Down,
    Bfly,
    Idx,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduxOp {
    Add,
    Min,
    Max,
    And,
    Or,
    Xor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VoteMode {
    All,
    Any,
    Uni,
    Ballot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarRed {
    Popc,
    And,
    Or,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockKind {
    Clock,
    Clock64,
    GlobalTimer,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Nop,
    Mov { bits: u8, d: u32, a: Src },
    /// `mov.b64 d, {a, b}`: parts from least significant.
    Pack { d: u32, parts: Vec<Src>, pbits: u8 },
    Unpack { ds: Vec<Option<u32>>, a: Src, pbits: u8 },
    I2 { f: I2, bits: u8, signed: bool, d: u32, a: Src, b: Src },
    I1 { f: I1, bits: u8, signed: bool, d: u32, a: Src },
    I3 { f: I3, bits: u8, signed: bool, d: u32, a: Src, b: Src, c: Src },
    Bfi { bits: u8, d: u32, a: Src, b: Src, c: Src, e: Src },
    F2 { f: F2, t: FT, m: FMod, d: u32, a: Src, b: Src },
    F1 { f: F1, t: FT, m: FMod, d: u32, a: Src },
    Fma { t: FT, m: FMod, d: u32, a: Src, b: Src, c: Src },
    /// f32 add/sub/mul/div/fma/sqrt and f64 add/sub/mul under `.rz`/`.rm`/`.rp` (`b`, `c`
    /// unused where the operation takes fewer sources; sub is lowered to add of `-b`).
    /// `isspacep.<space> d, a`: whether generic address `a` lies in `sp`.
    IsSpace { sp: Space, d: u32, a: Src },
    /// A failed device `assert`: ends the launch with the message, file, line and function.
    AssertFail { msg: Src, file: Src, line: Src, func: Src },
    Carry { f: CarryOp, bits: u8, signed: bool, cc_in: bool, cc_out: bool, d: u32, a: Src, b: Src, c: Src },
    FDirected { f: FDir, t: FT, mode: crate::float::Directed, m: FMod, d: u32, a: Src, b: Src, c: Src },
    Setp { cmp: Cmp, t: CmpTy, d: Option<u32>, d2: Option<u32>, a: Src, b: Src, comb: Option<(BoolOp, Src, bool)> },
    /// `set`: d is all ones (or 1.0f) when true.
    /// `yes` is what a true comparison writes (1.0 in the destination's float type, or all
    /// ones); for f16x2/bf16x2 sources each half is compared and gets its own `yes`.
    Set { cmp: Cmp, t: CmpTy, yes: u64, d: u32, a: Src, b: Src, comb: Option<(BoolOp, Src, bool)> },
    Selp { d: u32, a: Src, b: Src, p: Src },
    Cvt { to: CvtTy, from: CvtTy, rnd: Rnd, sat: bool, ftz: bool, d: u32, a: Src },
    /// The packed conversions: two f32 (`a` to the upper half, `b` to the lower) or one packed
    /// register `a` (`b` unused) into a packed `to`, rounding to nearest.
    CvtX2 { to: Packed, from: Option<Packed>, relu: bool, satfinite: bool, d: u32, a: Src, b: Src },
    /// Converts between a space's own addresses and generic ones.
    Cvta { to_generic: bool, sp: Space, d: u32, a: Src },
    /// `strong`: `.volatile`, `.relaxed` or `.acquire`, the loads a thread polls another's
    /// progress with (a cooperative launch lets other blocks run when a warp keeps polling).
    Ld { sp: Space, size: u8, sext: bool, strong: bool, ds: Vec<Option<u32>>, base: Src, off: i64 },
    St { sp: Space, size: u8, vals: Vec<Src>, base: Src, off: i64 },
    Atom { sp: Space, op: AtomOp, t: AtomTy, d: Option<u32>, base: Src, off: i64, b: Src, c: Option<Src> },
    Bra { target: u32 },
    Exit,
    Bar { red: Option<(BarRed, u32, Src, bool)> },
    Shfl { mode: ShflMode, d: u32, dp: Option<u32>, a: Src, b: Src, c: Src },
    /// A convergence point before a `.sync` warp operation (and `bar.warp.sync` itself): the
    /// lanes wait here until every live lane of the member mask has arrived.
    WarpSync { member: Src },
    /// `member`: the lanes voting (`vote.sync`'s mask; all lanes for the old unsynchronised form).
    Vote { mode: VoteMode, d: u32, p: Src, neg: bool, member: Src },
    Match { all: bool, bits: u8, d: u32, dp: Option<u32>, a: Src, member: Src },
    Activemask { d: u32 },
    /// `elect.sync d|p, member`: the lowest member lane is the leader; `d` gets its lane
    /// number, `p` is true in it alone.
    Elect { d: Option<u32>, p: u32, member: Src },
    /// `redux.sync` on 32-bit integers over the member lanes.
    Redux { op: ReduxOp, signed: bool, d: u32, a: Src, member: Src },
    /// vprintf(fmt, args); the return value (arguments consumed) goes to `ret`.
    Printf { fmt: Src, args: Src, ret: Option<(Space, u64)> },
    Clock { d: u32, kind: ClockKind },
    Trap,
    /// `mma.sync` and `wmma.mma`: a warp-wide matrix multiply-accumulate (crate::tensor).
    Mma(Box<Mma>),
    /// `wmma.load` / `wmma.store`.
    WmmaMem(Box<WmmaMem>),
    /// `ldmatrix` / `stmatrix` of 8x8 b16 matrices in shared memory.
    Matrix(Box<MatrixMem>),
    /// `movmatrix.sync.aligned.m8n8.trans.b16`.
    Movmatrix { d: u32, a: Src },
    /// `cvt.{rna,rn,rz}{.relu}{.satfinite}.tf32.f32`: an f32 rounded to tf32's 10 mantissa
    /// bits, in an f32 register with the low 13 bits clear.
    Tf32 { d: u32, a: Src, rnd: Rnd, relu: bool, satfinite: bool },
    /// `cp.async` and `cp.async.bulk`: performed when issued (a legal schedule of an
    /// asynchronous copy), so the group waits have nothing left to wait for.
    CpAsync(Box<CpAsync>),
    /// The mbarrier operations that do not wait (crate::mbarrier).
    Mbar(Box<Mbar>),
    /// `mbarrier.test_wait` / `try_wait`: a lane that sees its phase incomplete makes the
    /// warp give the other warps of the block a turn (they are the ones that can complete it).
    MbarWait(Box<Mbar>),
}

/// Element types of tensor-core operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmaTy {
    F16,
    BF16,
    Tf32,
    F32,
    F64,
    S8,
    U8,
    S32,
}

impl MmaTy {
    pub fn bits(self) -> u32 {
        match self {
            MmaTy::F16 | MmaTy::BF16 => 16,
            MmaTy::Tf32 | MmaTy::F32 | MmaTy::S32 => 32,
            MmaTy::F64 => 64,
            MmaTy::S8 | MmaTy::U8 => 8,
        }
    }
}

/// Which operand of a matrix multiply a fragment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragOf {
    A,
    B,
    /// C or D (M x N).
    C,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Mma {
    /// M, N, K.
    pub shape: [u8; 3],
    /// `wmma.mma` (the sim's own fragment layout) rather than `mma.sync` (the ISA's).
    pub wmma: bool,
    pub a_ty: MmaTy,
    pub b_ty: MmaTy,
    pub c_ty: MmaTy,
    pub d_ty: MmaTy,
    pub satfinite: bool,
    pub d: Vec<u32>,
    pub a: Vec<Src>,
    pub b: Vec<Src>,
    pub c: Vec<Src>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct WmmaMem {
    pub load: bool,
    pub of: FragOf,
    pub shape: [u8; 3],
    /// Column-major in memory.
    pub col: bool,
    pub ty: MmaTy,
    pub sp: Space,
    /// Registers written (load) or read (store, as `Src::R`).
    pub regs: Vec<Src>,
    pub base: Src,
    pub off: i64,
    /// Elements between rows (row-major) or columns; `None`: the matrix is dense.
    pub stride: Option<Src>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MatrixMem {
    /// `ldmatrix` (else `stmatrix`).
    pub load: bool,
    pub trans: bool,
    pub sp: Space,
    /// One register per 8x8 matrix (1, 2 or 4).
    pub regs: Vec<Src>,
    pub base: Src,
    pub off: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CpAsync {
    pub dst_sp: Space,
    pub src_sp: Space,
    pub dst: Src,
    pub doff: i64,
    pub src: Src,
    pub soff: i64,
    /// Bytes written at the destination.
    pub size: Src,
    /// Bytes read from the source (the rest of `size` is zero-filled).
    pub src_size: Option<Src>,
    /// `ignore-src` predicate (and its negation): when true nothing is read, all zero-filled.
    pub ignore: Option<(Src, bool)>,
    /// `cp.async.bulk ... .mbarrier::complete_tx::bytes`: the barrier whose tx-count drops by `size`.
    pub mbar: Option<(Src, i64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MbarOp {
    Init,
    /// `arrive`/`arrive_drop` (`drop`), with `expect_tx` first when `tx`.
    Arrive { drop: bool, tx: bool },
    ExpectTx,
    CompleteTx,
    /// `test_wait`/`try_wait`, against a state token or (`parity`) a phase parity.
    Wait { parity: bool },
    Inval,
    /// `mbarrier.pending_count`: of a state token, no memory access.
    PendingCount,
    /// `cp.async.mbarrier.arrive`: the cp.asyncs before it are complete, so only `.noinc`
    /// changes the barrier (an arrival not counted in advance).
    CpAsyncArrive { noinc: bool },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Mbar {
    pub op: MbarOp,
    pub d: Option<u32>,
    pub sp: Space,
    pub base: Src,
    pub off: i64,
    /// Count, tx-count, state token or parity, by `op`.
    pub b: Src,
}

#[derive(Debug, Clone)]
pub struct Inst {
    /// `@p` / `@!p`: register and negation.
    pub guard: Option<(u32, bool)>,
    pub op: Op,
    /// Source line, for error messages.
    pub line: u32,
}

/// Special registers: fixed register indices, filled in per warp.
/// The bit of a register id that says its values are 64-bit ([`Program::nwide`]). A register
/// declared with a type of at most 32 bits has a 32-bit row: each PTX instruction writes it
/// with a value of its declared width, and half the bytes move per warp-instruction.
pub const WIDE: u32 = 1 << 31;

pub mod special {
    pub const TID_X: u32 = 0;
    pub const TID_Y: u32 = 1;
    pub const TID_Z: u32 = 2;
    pub const LANEID: u32 = 3;
    pub const WARPID: u32 = 4;
    pub const NTID_X: u32 = 5;
    pub const NTID_Y: u32 = 6;
    pub const NTID_Z: u32 = 7;
    pub const CTAID_X: u32 = 8;
    pub const CTAID_Y: u32 = 9;
    pub const CTAID_Z: u32 = 10;
    pub const NCTAID_X: u32 = 11;
    pub const NCTAID_Y: u32 = 12;
    pub const NCTAID_Z: u32 = 13;
    pub const LANEMASK_EQ: u32 = 14;
    pub const LANEMASK_LT: u32 = 15;
    pub const LANEMASK_LE: u32 = 16;
    pub const LANEMASK_GT: u32 = 17;
    pub const LANEMASK_GE: u32 = 18;
    pub const NWARPID: u32 = 19;
    pub const SMID: u32 = 20;
    pub const NSMID: u32 = 21;
    pub const GRIDID: u32 = 22;
    pub const DYN_SMEM: u32 = 23;
    pub const TOTAL_SMEM: u32 = 24;
    /// The carry flag of carry chains (`CC.CF`), one per thread; not nameable in PTX.
    pub const CC: u32 = 25;
    /// `%envreg1`/`%envreg2`: the high and low halves of the grid-sync workspace's address
    /// (cooperative groups' `grid.sync()` spins on a word there); 0 outside cooperative launches,
    /// where `grid.sync()` traps as on a GPU.
    pub const ENVREG1: u32 = 26;
    pub const ENVREG2: u32 = 27;
    pub const COUNT: u32 = 28;

    pub fn lookup(name: &str) -> Option<u32> {
        Some(match name {
            "%tid.x" => TID_X,
            "%tid.y" => TID_Y,
            "%tid.z" => TID_Z,
            "%laneid" => LANEID,
            "%warpid" => WARPID,
            "%ntid.x" => NTID_X,
            "%ntid.y" => NTID_Y,
            "%ntid.z" => NTID_Z,
            "%ctaid.x" => CTAID_X,
            "%ctaid.y" => CTAID_Y,
            "%ctaid.z" => CTAID_Z,
            "%nctaid.x" => NCTAID_X,
            "%nctaid.y" => NCTAID_Y,
            "%nctaid.z" => NCTAID_Z,
            "%lanemask_eq" => LANEMASK_EQ,
            "%lanemask_lt" => LANEMASK_LT,
            "%lanemask_le" => LANEMASK_LE,
            "%lanemask_gt" => LANEMASK_GT,
            "%lanemask_ge" => LANEMASK_GE,
            "%nwarpid" => NWARPID,
            "%smid" => SMID,
            "%nsmid" => NSMID,
            "%gridid" => GRIDID,
            "%dynamic_smem_size" => DYN_SMEM,
            "%total_smem_size" => TOTAL_SMEM,
            "%envreg1" => ENVREG1,
            "%envreg2" => ENVREG2,
            _ => return None,
        })
    }
}

/// One kernel, ready to run.
#[derive(Debug, Clone)]
pub struct Program {
    pub name: String,
    pub insts: Vec<Inst>,
    /// Registers per thread of 32-bit rows (every register declared with a type of at most
    /// 32 bits, the special registers included): ids `0..nregs`.
    pub nregs: u32,
    /// Registers per thread of 64-bit rows: ids `WIDE | 0..WIDE | nwide`.
    pub nwide: u32,
    /// Bytes of local memory per thread.
    pub local_size: u64,
    /// Bytes of static shared memory; dynamic shared memory starts at
    /// `dyn_shared_offset`.
    pub shared_static: u64,
    pub dyn_shared_offset: u64,
    /// Size of the kernel's parameter buffer.
    pub param_size: u64,
    /// Per pc: where the lanes a guarded branch there divides meet again (`u32::MAX`: nowhere
    /// before the exit).
    pub reconv: Vec<u32>,
    /// Per pc: whether some branch's lanes meet again here.
    pub joins: Vec<bool>,
    /// The compiled tier's form of `insts` (built from them and `joins` at lowering; a
    /// caller that edits either must rebuild it).
    pub compiled: crate::exec::Compiled,
}

impl Program {
    /// Bytes of registers a thread holds.
    pub fn register_bytes(&self) -> u64 {
        self.nregs as u64 * 4 + self.nwide as u64 * 8
    }

    /// Every thread exits at its first instruction: running the kernel
    /// changes nothing, so a launch of it is complete as soon as it is made.
    pub fn does_nothing(&self) -> bool {
        matches!(self.insts.first(), Some(Inst { guard: None, op: Op::Exit, .. }) | None)
    }
}
