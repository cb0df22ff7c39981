/* msg.c: control messages (FI_MSG): small sends, and the hub's queue of received ones. */
#include "internal.h"

int kx_send(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len)
{
    return kx_send_op(r, peer, gen, data, len, 0, 0, 50000000LL);
}

int kx_send_try(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len)
{
    return kx_send_op(r, peer, gen, data, len, 0, 0, 0);
}

/* Post one message: a user's (ctl 0, fi_send) or one of the revoke exchange's (ctl: its
 * data word, tagged KX_CTL_TAG; token: how its completion is reported, revoke.c). While the
 * provider's queue is full, retry for `wait_ns` (0: one try; the progress thread, which
 * must not wait on itself). */
int kx_send_op(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len, uint64_t ctl,
               uint64_t token, int64_t wait_ns)
{
    kx_sendbuf *s = malloc(sizeof(kx_sendbuf) + (len ? len : 1));
    if (!s)
        return -FI_ENOMEM;
    memset(&s->op, 0, sizeof(s->op));
    s->op.kind = KX_OP_SEND;
    s->op.owner = s;
    s->peer = peer;
    s->gen = gen;
    s->mr = NULL;
    s->token = token;
    s->len = len;
    if (len)
        memcpy(s->data, data, len);
    void *desc = NULL;
    if (!kx_enter(r)) {                  /* one bracket: registration, post and cleanup */
        free(s);
        return -FI_ECANCELED;
    }
    if (r->mr_mode & FI_MR_LOCAL) {      /* the provider wants even message buffers registered */
        uint64_t key, base;
        uint8_t raw[64];
        size_t rawlen;
        const char *call;
        int ret = kx_mr_register(r, s->data, len ? len : 1, FI_HMEM_SYSTEM, 0, -1, 0, &s->mr, &key, &desc,
                                 raw, &rawlen, &base, &call);
        if (ret) {
            kx_leave(r);
            free(s);
            return ret;
        }
    }
    __atomic_add_fetch(&r->outstanding, 1, __ATOMIC_SEQ_CST);
    ssize_t ret;
    /* queue full: let the progress thread drain it, for wait_ns at most; the caller retries */
    int64_t until = kx_now_ns() + wait_ns;
    for (;;) {
        int gone = kx_peer_enter(r, peer, gen);     /* never to a closed, exited or stalled peer */
        if (gone) {
            ret = -gone;
            break;
        }
        /* the peer's entry (counts, bell) only while entered: kx_av_remove waits for that */
        kx_peer_count(r, peer, 1);
        if (ctl) {
            /* no FI_DELIVERY_COMPLETE: rxm 1.17 hung inside such a send between two engines
             * of one process (a messenger test, once in 136). A completion says the bytes
             * left (tcp: in the peer's socket; shm: in its queue), and the peer's flush
             * (kx_rail_flush) then reads them: what connect()'s wait for a HELLO relies on */
            ret = fi_senddata(r->ep, s->data, len, desc, ctl, peer, &s->op.fi);
        } else {
            ret = fi_send(r->ep, s->data, len, desc, peer, &s->op.fi);
        }
        if (ret == 0)
            kx_peer_accepted(r, peer);
        else
            kx_peer_uncount(r, peer, ret == -FI_EAGAIN);
        kx_peer_leave(r, peer);
        if (ret != -FI_EAGAIN || r->stop || kx_now_ns() >= until)
            break;
        kx_wake(r);
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    if (ret) {
        __atomic_sub_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
        if (s->mr)
            fi_close(&s->mr->fid);
        free(s);
    }
    kx_leave(r);
    if (ret)
        return (int)ret;
    kx_wake(r);
    return 0;
}

int kx_recv_wait(kx_rail *r, int64_t slice_ns, kx_msg **out)
{
    kx_hub *h = r->hub;
    struct timespec ts;
    slice_ns = kx_drive_for_message(r, (void *const *)&h->msg_head, slice_ns);
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&h->lock);
    /* quiet messages (announce.c: armed for a waiting caller) wake nobody: they go with the
     * next loud one, or once the slice has passed */
    while (!h->nloud && !r->stop) {
        if (pthread_cond_timedwait(&h->msg_cond, &h->lock, &ts) == ETIMEDOUT)
            break;
    }
    kx_msg *m = h->msg_head;
    if (m) {
        h->msg_head = m->next;
        if (!h->msg_head)
            h->msg_tail = NULL;
        h->nmsgs--;
        if (!m->quiet)
            h->nloud--;
    }
    pthread_mutex_unlock(&h->lock);
    *out = m;
    return m != NULL;
}

size_t kx_msg_len(const kx_msg *m) { return m->len; }
const char *kx_msg_data(const kx_msg *m) { return m->data; }
void kx_msg_free(kx_msg *m) { free(m); }
