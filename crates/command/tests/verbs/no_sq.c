/* QPs without a send queue under `gpuverbs emu` (mlx5_ib creates them with no_sq): an RC QP with
 * max_send_wr 0 and 1,024 receives (qperf's servers) and a UD QP with max_send_wr 0 and 16
 * receives are created; the RC one, in RTR, takes a SEND from an ordinary RC QP of the same
 * device into a posted receive, checked byte for byte; posting a send on it fails. Prints
 * "no_sq ok"; exits 1 at the first wrong answer. */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what) {
    fprintf(stderr, "no_sq: %s\n", what);
    return 1;
}

static int to_rtr(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid) {
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_REMOTE_WRITE};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                  IBV_QP_ACCESS_FLAGS))
        return 1;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = *gid;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.port_num = 1;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                     IBV_QP_MIN_RNR_TIMER);
}

int main(void) {
    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0]) return fail("no RDMA device");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
    struct ibv_cq *cq = pd ? ibv_create_cq(ctx, 2048, NULL, NULL, 0) : NULL;
    if (!cq) return fail("device, PD or CQ");
    union ibv_gid gid;
    if (ibv_query_gid(ctx, 1, 0, &gid)) return fail("ibv_query_gid");

    struct ibv_qp_init_attr rc = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                  .cap = {.max_send_wr = 0, .max_recv_wr = 1024,
                                          .max_send_sge = 1, .max_recv_sge = 1}};
    struct ibv_qp *rx = ibv_create_qp(pd, &rc);
    if (!rx) return fail("RC QP with max_send_wr 0");
    printf("RC QP %#x without a send queue: max_recv_wr %u\n", rx->qp_num, rc.cap.max_recv_wr);
    struct ibv_qp_init_attr ud = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD,
                                  .cap = {.max_send_wr = 0, .max_recv_wr = 16,
                                          .max_send_sge = 1, .max_recv_sge = 1}};
    struct ibv_qp *udqp = ibv_create_qp(pd, &ud);
    if (!udqp) return fail("UD QP with max_send_wr 0");
    printf("UD QP %#x without a send queue\n", udqp->qp_num);

    struct ibv_qp_init_attr tx_attr = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                       .cap = {.max_send_wr = 16, .max_recv_wr = 1,
                                               .max_send_sge = 1, .max_recv_sge = 1}};
    struct ibv_qp *tx = ibv_create_qp(pd, &tx_attr);
    if (!tx) return fail("the sender");
    enum { LEN = 3000 };
    char *src = malloc(LEN), *dst = calloc(1, LEN);
    for (int i = 0; i < LEN; i++) src[i] = (char)(i * 7 + 1);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, LEN, 0);
    struct ibv_mr *dmr = ibv_reg_mr(pd, dst, LEN, IBV_ACCESS_LOCAL_WRITE);
    if (!smr || !dmr) return fail("ibv_reg_mr");

    if (to_rtr(rx, tx->qp_num, &gid) || to_rtr(tx, rx->qp_num, &gid)) return fail("to RTR");
    struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
                              .rnr_retry = 7, .sq_psn = 0, .max_rd_atomic = 1};
    if (ibv_modify_qp(tx, &rts, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        return fail("sender to RTS");

    struct ibv_sge rsge = {.addr = (uintptr_t)dst, .length = LEN, .lkey = dmr->lkey};
    struct ibv_recv_wr rwr = {.wr_id = 1, .sg_list = &rsge, .num_sge = 1}, *bad_r;
    if (ibv_post_recv(rx, &rwr, &bad_r)) return fail("post_recv on the QP without an SQ");
    struct ibv_sge ssge = {.addr = (uintptr_t)src, .length = LEN, .lkey = smr->lkey};
    struct ibv_send_wr swr = {.wr_id = 2, .sg_list = &ssge, .num_sge = 1,
                              .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED},
                       *bad_s;
    if (ibv_post_send(rx, &swr, &bad_s) == 0) return fail("a send posted on a QP without an SQ");
    if (ibv_post_send(tx, &swr, &bad_s)) return fail("post_send on the sender");

    int seen = 0;
    for (long spins = 0; seen < 2 && spins < 200000000L; spins++) {
        struct ibv_wc wc;
        int n = ibv_poll_cq(cq, 1, &wc);
        if (n < 0) return fail("ibv_poll_cq");
        if (n == 0) continue;
        if (wc.status != IBV_WC_SUCCESS) return fail(ibv_wc_status_str(wc.status));
        if (wc.wr_id == 1 && (wc.opcode != IBV_WC_RECV || wc.byte_len != LEN))
            return fail("the receive's completion");
        seen++;
    }
    if (seen < 2) return fail("completions did not come");
    if (memcmp(src, dst, LEN)) return fail("the bytes received differ");
    printf("%d bytes received by the QP without a send queue, checked\n", LEN);
    ibv_destroy_qp(tx);
    ibv_destroy_qp(udqp);
    ibv_destroy_qp(rx);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
    ibv_destroy_cq(cq);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    printf("no_sq ok\n");
    return 0;
}
