/* XRC under `gpuverbs emu`, two contexts of one device: the domain of a file is shared by the
 * contexts that open it (O_CREAT makes it, a second open without O_CREAT finds it, O_EXCL is
 * refused while it is open, a file nobody opened without O_CREAT is refused); an XRC initiator
 * of context A sends through an XRC target of context B (opened on the same file) into an XRC
 * SRQ of context A: a SEND and an RDMA WRITE land, byte for byte, the SEND's completion on the
 * SRQ's CQ naming the target; CLOSE_XRCD of a domain an SRQ uses is EBUSY; context A opens
 * the target by number (ibv_open_qp; a number no target of the domain has, or another QP type,
 * is EINVAL), B destroys its handle, and the target, held by A's, still takes a SEND; a SEND
 * naming an SRQ of another domain completes with IBV_WC_REM_INV_REQ_ERR. Prints "xrc ok";
 * exits 1 at the first wrong answer. */
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fail(const char *what) {
    fprintf(stderr, "xrc: %s (errno %d)\n", what, errno);
    return 1;
}

static struct ibv_xrcd *open_xrcd(struct ibv_context *c, int fd, int oflags) {
    struct ibv_xrcd_init_attr a = {.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS,
                                   .fd = fd, .oflags = oflags};
    return ibv_open_xrcd(c, &a);
}

static struct ibv_srq *xsrq(struct ibv_context *c, struct ibv_pd *pd, struct ibv_xrcd *x,
                            struct ibv_cq *cq) {
    struct ibv_srq_init_attr_ex a = {.attr = {.max_wr = 16, .max_sge = 1},
                                     .comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD |
                                                  IBV_SRQ_INIT_ATTR_CQ | IBV_SRQ_INIT_ATTR_PD,
                                     .srq_type = IBV_SRQT_XRC, .xrcd = x, .cq = cq, .pd = pd};
    return ibv_create_srq_ex(c, &a);
}

/* RESET → INIT → RTR → RTS, connected to `dest` on this device. */
static int connect_qp(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid, int access, int tgt) {
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return 1;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = *gid;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.port_num = 1;
    int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
    if (tgt) rtr |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    if (ibv_modify_qp(qp, &a, rtr)) return 1;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    int rts = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN;
    if (!tgt) rts |= IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    return ibv_modify_qp(qp, &a, rts);
}

static int wait_cqe(struct ibv_cq *cq, struct ibv_wc *wc) {
    for (long i = 0; i < 200000000; i++) {
        int n = ibv_poll_cq(cq, 1, wc);
        if (n) return n < 0;
    }
    return 1;
}

static int post(struct ibv_qp *qp, enum ibv_wr_opcode op, struct ibv_sge *s, uint32_t srqn,
                uint64_t raddr, uint32_t rkey) {
    struct ibv_send_wr w = {.wr_id = 7, .sg_list = s, .num_sge = 1, .opcode = op,
                            .send_flags = IBV_SEND_SIGNALED}, *bad;
    w.qp_type.xrc.remote_srqn = srqn;
    w.wr.rdma.remote_addr = raddr;
    w.wr.rdma.rkey = rkey;
    return ibv_post_send(qp, &w, &bad);
}

int main(void) {
    char f1[] = "/tmp/gpuverbs-xrc-XXXXXX", f2[] = "/tmp/gpuverbs-xrc-XXXXXX";
    int fd1 = mkstemp(f1), fd2 = mkstemp(f2);
    if (fd1 < 0 || fd2 < 0) return fail("mkstemp");
    unlink(f1);
    unlink(f2);
    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0]) return fail("no RDMA device");
    struct ibv_context *a = ibv_open_device(list[0]), *b = ibv_open_device(list[0]);
    if (!a || !b) return fail("two contexts");
    union ibv_gid gid;
    if (ibv_query_gid(a, 1, 0, &gid)) return fail("ibv_query_gid");
    struct ibv_device_attr da;
    if (ibv_query_device(a, &da) || !(da.device_cap_flags & IBV_DEVICE_XRC))
        return fail("IBV_DEVICE_XRC");

    /* the domain of file 1: made by A, found by B, O_EXCL refused while open */
    struct ibv_xrcd *xa = open_xrcd(a, fd1, O_CREAT);
    if (!xa) return fail("open_xrcd O_CREAT");
    struct ibv_xrcd *xb = open_xrcd(b, fd1, 0);
    if (!xb) return fail("open_xrcd of an open domain without O_CREAT");
    if (open_xrcd(b, fd1, O_CREAT | O_EXCL) || errno != EINVAL)
        return fail("O_EXCL on an open domain must be EINVAL");
    if (open_xrcd(b, fd2, 0) || errno != EINVAL)
        return fail("no domain and no O_CREAT must be EINVAL");
    struct ibv_xrcd *other = open_xrcd(b, fd2, O_CREAT);
    if (!other) return fail("open_xrcd of file 2");

    struct ibv_pd *pa = ibv_alloc_pd(a), *pb = ibv_alloc_pd(b);
    struct ibv_cq *cqa = ibv_create_cq(a, 64, NULL, NULL, 0);
    struct ibv_cq *sq_cq = ibv_create_cq(a, 64, NULL, NULL, 0);
    struct ibv_cq *cqb = ibv_create_cq(b, 64, NULL, NULL, 0);
    if (!pa || !pb || !cqa || !sq_cq || !cqb) return fail("PDs and CQs");
    char *buf = calloc(1, 8192);
    struct ibv_mr *mr = ibv_reg_mr(pa, buf, 8192, IBV_ACCESS_LOCAL_WRITE |
                                                      IBV_ACCESS_REMOTE_WRITE);
    if (!mr) return fail("ibv_reg_mr");
    struct ibv_srq *srq = xsrq(a, pa, xa, cqa);
    struct ibv_srq *foreign = xsrq(b, pb, other, cqb);
    if (!srq || !foreign) return fail("XRC SRQs");
    uint32_t srqn, foreign_n;
    if (ibv_get_srq_num(srq, &srqn) || ibv_get_srq_num(foreign, &foreign_n))
        return fail("ibv_get_srq_num");
    if (ibv_close_xrcd(xa) != EBUSY) return fail("CLOSE_XRCD of a domain in use must be EBUSY");

    /* the target in B (domain of file 1), the initiator in A */
    struct ibv_qp_init_attr_ex t = {.qp_type = IBV_QPT_XRC_RECV,
                                    .comp_mask = IBV_QP_INIT_ATTR_XRCD, .xrcd = xb};
    struct ibv_qp *tgt = ibv_create_qp_ex(b, &t);
    struct ibv_qp_init_attr_ex i = {.qp_type = IBV_QPT_XRC_SEND, .send_cq = sq_cq,
                                    .cap = {.max_send_wr = 16, .max_send_sge = 1},
                                    .comp_mask = IBV_QP_INIT_ATTR_PD, .pd = pa};
    struct ibv_qp *ini = ibv_create_qp_ex(a, &i);
    if (!tgt || !ini) return fail("XRC target and initiator");
    if (connect_qp(tgt, ini->qp_num, &gid, IBV_ACCESS_REMOTE_WRITE, 1) ||
        connect_qp(ini, tgt->qp_num, &gid, 0, 0))
        return fail("connect the XRC pair");

    struct ibv_sge rs = {.addr = (uintptr_t)buf + 4096, .length = 4096, .lkey = mr->lkey}, *bad;
    struct ibv_recv_wr r = {.wr_id = 9, .sg_list = &rs, .num_sge = 1}, *rbad;
    if (ibv_post_srq_recv(srq, &r, &rbad)) return fail("ibv_post_srq_recv");
    (void)bad;
    for (int k = 0; k < 3000; k++) buf[k] = (char)(k * 7 + 1);
    struct ibv_sge s = {.addr = (uintptr_t)buf, .length = 3000, .lkey = mr->lkey};
    struct ibv_wc wc;
    if (post(ini, IBV_WR_SEND, &s, srqn, 0, 0)) return fail("post SEND");
    if (wait_cqe(sq_cq, &wc) || wc.status) return fail("SEND completion");
    if (wait_cqe(cqa, &wc) || wc.status || wc.wr_id != 9 || wc.byte_len != 3000 ||
        wc.qp_num != tgt->qp_num)
        return fail("receive on the SRQ's CQ (status, wr_id, length, target QPN)");
    if (memcmp(buf, buf + 4096, 3000)) return fail("SEND bytes");
    printf("SEND of 3000 bytes through target %#x into SRQ %#x\n", tgt->qp_num, srqn);

    memset(buf + 6000, 0, 1000);
    struct ibv_sge ws = {.addr = (uintptr_t)buf, .length = 1000, .lkey = mr->lkey};
    if (post(ini, IBV_WR_RDMA_WRITE, &ws, srqn, (uintptr_t)buf + 6000, mr->rkey))
        return fail("post WRITE");
    if (wait_cqe(sq_cq, &wc) || wc.status) return fail("WRITE completion");
    if (memcmp(buf, buf + 6000, 1000)) return fail("WRITE bytes");

    /* A opens B's target; B's handle goes; the target stays for A's */
    struct ibv_qp_open_attr oa = {.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD |
                                               IBV_QP_OPEN_ATTR_TYPE,
                                  .qp_num = tgt->qp_num, .xrcd = xa, .qp_type = IBV_QPT_XRC_RECV};
    struct ibv_qp *opened = ibv_open_qp(a, &oa);
    if (!opened || opened->qp_num != tgt->qp_num) return fail("ibv_open_qp of the target");
    oa.qp_num = tgt->qp_num + 77;
    if (ibv_open_qp(a, &oa) || errno != EINVAL) return fail("open of no target must be EINVAL");
    oa.qp_num = tgt->qp_num;
    oa.qp_type = IBV_QPT_RC;
    if (ibv_open_qp(a, &oa) || errno != EINVAL) return fail("open as RC must be EINVAL");
    struct ibv_qp_attr qa;
    struct ibv_qp_init_attr qi;
    if (ibv_query_qp(opened, &qa, IBV_QP_STATE, &qi) || qa.qp_state != IBV_QPS_RTS)
        return fail("query through the opened handle");
    if (ibv_destroy_qp(tgt)) return fail("destroy B's target handle");
    if (ibv_post_srq_recv(srq, &r, &rbad)) return fail("ibv_post_srq_recv");
    if (post(ini, IBV_WR_SEND, &s, srqn, 0, 0)) return fail("post SEND after B's handle went");
    if (wait_cqe(sq_cq, &wc) || wc.status) return fail("SEND through the opened target");
    if (wait_cqe(cqa, &wc) || wc.status || wc.byte_len != 3000)
        return fail("receive through the opened target");
    if (ibv_close_xrcd(xb)) return fail("B's domain handle, now unused");
    printf("the target lives on in A's opened handle\n");

    if (post(ini, IBV_WR_SEND, &s, foreign_n, 0, 0)) return fail("post SEND to a foreign SRQ");
    if (wait_cqe(sq_cq, &wc) || wc.status != IBV_WC_REM_INV_REQ_ERR)
        return fail("a foreign SRQ must be IBV_WC_REM_INV_REQ_ERR");

    /* The opened handle is left to the device's close: libmlx5 44's mlx5_destroy_qp frees the
     * doorbell record an opened QP never had (mlx5_free_db of NULL), which corrupts its
     * doorbell-page map, on a ConnectX as here. While it is open its domain is in use. */
    if (ibv_destroy_qp(ini) || ibv_destroy_srq(srq) || ibv_destroy_srq(foreign) ||
        ibv_close_xrcd(other))
        return fail("teardown");
    if (ibv_close_xrcd(xa) != EBUSY) return fail("a domain with an opened target is in use");
    printf("xrc ok\n");
    return 0;
}
