/* forget.c: a closed shm engine of this process leaves the maps of the live engines that hold
 * it, so that its deferred close (local.c) completes now instead of when they close.
 *
 * What holds it (libfabric 1.17, prov/util/src/util_shm.c and prov/shm/src): an endpoint of
 * this process finds a same-process peer's region through shm's process-wide list of the
 * regions it created (`ep_name_list`, smr_map_to_region) and keeps that pointer in its AV's
 * map (`smr_map.peers[id].region`). The entry is made when the peer's name is inserted into
 * its AV and also, without any insert, when its progress reads the peer's first command (the
 * connection request, smr_progress_connreq: it also reads the peer's pid in the peer's
 * region). Its progress writes the answers to the peer's commands into the peer's region
 * (smr_peer_region(region, cmd's id)). Only smr_map_del drops the entry, called by
 * fi_av_remove (smr_av_remove) and the AV's close; for a same-process peer it unmaps nothing
 * (the list still names the region: 1.17 never takes an endpoint off it) and, since it runs
 * before smr_unmap_from_endpoint, touches nothing in the peer's region either.
 *
 * So a holder H may let a closed engine S go once (1) S posts nothing more (its rail is
 * quiesced), (2) nothing of S is pending at H but commands still in H's queue: S's rail had
 * nothing outstanding (shm completes an inline or inject command at the sender when posted,
 * every other kind only once the target answered), (3) H's progress has read every command S
 * wrote into H's queue (shm reads it in order: its read count has passed the write count
 * taken when S quiesced), and (4) H's AV no longer maps S: H's progress thread removes S's
 * address (inserting it first where only a connection request mapped it, while S's region
 * still exists), under the AV lock, from its own turn on the CQ, so nothing of H reads the
 * map meanwhile. Then H drops its holds and the last one closes S's fids (rail.c).
 *
 * (5) H's own table of its peers must forget S's slot too. 1.17 leaves in it, for the slot
 * id, the id S knows H by and whether H sent S its name (smr_peer_data: addr.id, name_sent,
 * set by S's reading of H's connection request): smr_av_remove clears only the slot's name
 * (smr_unmap_from_endpoint returns early, smr_map_del having set peer.id to -1 first). The
 * next peer shm puts in that slot (smr_map_add reuses the lowest free id from its cursor: the
 * very slot, when S was the last one added) would then be sent commands naming S's id for H,
 * without a connection request: shm at that peer reads a map entry it never made (seen: the
 * next short engine of the same loop crashed in fi_cq_read, SIGSEGV, its first cycle). So
 * after the remove kvxfer sets that slot's addr.id to -1 and name_sent to 0, as a fresh
 * region has them (smr_create), and the next peer gets a connection request first.
 *
 * (3) and (5) need shm's region layout, which kvxfer reads in H's own region (struct
 * smr_region: version 4 at byte 0, the owner's pid at 4, total_size at 40, cmd_queue_offset
 * at 64, resp_queue_offset at 72, peer_data_offset at 96, name_offset at 104; at the command
 * queue an ofi_cirque: size, size_mask, read count, write count, then size commands of 256
 * bytes; the peer table: 256 smr_peer_data of 272 bytes, name[256] then the int64 id, then
 * sar_status and name_sent). kvxfer maps the first page and the peer table of its own region
 * and uses them only when all of that checks out (the queue ends where the response queue
 * starts, the table where the name starts); otherwise nothing is forgotten and the close stays
 * deferred until the holder closes, as before (KVXFER_SHM_FORGET=0 does that on purpose: the
 * tests of the deferral itself). */

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "smr117.h"

#define KX_FORGET_BATCH 8

/* map our own region's first page and peer table: c->cmdq, c->peer_data (else NULL) */
void kx_forget_map_cmdq(kx_local *c, const char *prov)
{
    c->cmdq = NULL;
    c->cmdq_map = NULL;
    c->peer_data = NULL;
    c->peer_map = NULL;
    /* KVXFER_SHM_FORGET=0: never forget, defer as before (tests) */
    int fd = kx_shm_open_own(prov, c->name, c->len, "KVXFER_SHM_FORGET");
    if (fd < 0)
        return;
    struct stat st;
    void *m = fstat(fd, &st) == 0 && st.st_size >= 4096
                  ? mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (m == MAP_FAILED) {
        close(fd);
        return;
    }
    const unsigned char *b = m;
    int pid;
    memcpy(&pid, b + KX_SMR_PID_OFF, sizeof(pid));
    uint64_t total = kx_smr_u64(b, KX_SMR_TOTAL_OFF), q = kx_smr_u64(b, KX_SMR_CMDQ_OFF);
    uint64_t resp = kx_smr_u64(b, KX_SMR_RESPQ_OFF);
    uint64_t peers = kx_smr_u64(b, KX_SMR_PEERS_OFF), name = kx_smr_u64(b, KX_SMR_NAME_OFF);
    int ok = b[0] == KX_SMR_VERSION && pid == getpid() && total == (uint64_t)st.st_size && kx_smr_pow2(total) &&
             q >= KX_SMR_RESPQ_OFF + 8 && q % 16 == 0 && q + 32 <= 4096;
    if (ok) {
        uint64_t size = kx_smr_u64(b, q), mask = kx_smr_u64(b, q + 8);
        uint64_t rd = kx_smr_u64(b, q + 16), wr = kx_smr_u64(b, q + 24);
        ok = kx_smr_pow2(size) && mask == size - 1 && wr - rd <= size &&
             resp == q + 32 + KX_SMR_CMD_SIZE * size &&
             peers > resp && name == peers + (uint64_t)KX_SMR_MAX_PEERS * KX_SMR_PEER_SIZE && name < total;
    }
    void *pm = MAP_FAILED;
    size_t off = 0, len = 0;
    if (ok) {
        off = peers & ~(uint64_t)4095;
        len = (size_t)(name - off);
        pm = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)off);
    }
    close(fd);
    if (pm == MAP_FAILED) {
        munmap(m, 4096);
        return;
    }
    c->cmdq_map = m;
    c->cmdq = (const volatile uint64_t *)(b + q + 16);
    c->peer_map = pm;
    c->peer_map_len = len;
    c->peer_data = (unsigned char *)pm + (peers - off);
}

/* the slot of H's peer table that names `name` (with or without shm's "fi_shm://"), or -1 */
static int kx_forget_slot(const kx_local *self, const void *name, size_t len)
{
    const char *n = name, *bare = len > 9 && memcmp(n, "fi_shm://", 9) == 0 ? n + 9 : n;
    size_t nl = strnlen(n, len), bl = strnlen(bare, len - (size_t)(bare - n));
    for (int k = 0; k < KX_SMR_MAX_PEERS; k++) {
        const char *s = (const char *)self->peer_data + (size_t)k * KX_SMR_PEER_SIZE;
        size_t sl = strnlen(s, 256);
        if ((sl == nl && !memcmp(s, n, nl)) || (sl == bl && !memcmp(s, bare, bl)))
            return k;
    }
    return -1;
}

/* H's slot k as a fresh region has it: nobody known by it, no name sent (see (5) above) */
static void kx_forget_slot_reset(kx_local *self, int k)
{
    unsigned char *e = self->peer_data + (size_t)k * KX_SMR_PEER_SIZE;
    int64_t none = -1;
    uint32_t zero = 0;
    memcpy(e + KX_SMR_PEER_ID, &none, sizeof(none));
    memcpy(e + KX_SMR_PEER_NAME_SENT, &zero, sizeof(zero));
}

/* For kx_av_remove of any shm peer (another process's too; see (5) above): the slot of r's
 * own peer table that `fa` uses, found before the remove (-1: none, or the layout unknown) */
int kx_forget_slot_of(kx_rail *r, fi_addr_t fa)
{
    kx_local *self = r->self_local;
    if (!self || !self->peer_data)
        return -1;
    char name[256];
    size_t len = sizeof(name);
    if (fi_av_lookup(r->av, fa, name, &len) != 0 || len == 0 || len > sizeof(name))
        return -1;
    return kx_forget_slot(self, name, len);
}

/* ... and after it: the slot as a fresh region has it */
void kx_forget_slot_clear(kx_rail *r, int slot)
{
    if (slot >= 0 && r->self_local && r->self_local->peer_data)
        kx_forget_slot_reset(r->self_local, slot);
}

/* drop c from r's AV (tracked entries through the peer table, else an insert and a remove of
 * its name) and then r's holds of it; 0 if it must wait for a later pass */
static int kx_forget_one(kx_rail *r, kx_local *c)
{
    if (pthread_mutex_trylock(&r->av_lock))
        return 0;          /* a caller inserts or removes: next pass */
    int done = 0;
    if (!kx_enter(r))
        goto unlock;       /* closing: its quiesce drops every hold */
    kx_local *self = r->self_local;
    size_t hi = __atomic_load_n(&r->peer_hi, __ATOMIC_ACQUIRE);
    int tracked = 0, slot = -1;
    for (size_t i = 0; i < hi; i++) {
        fi_addr_t fa = (fi_addr_t)i;
        kx_peer *p = kx_peer_get(r, fa);
        if (!p || p->removed || p->local != c)
            continue;
        pthread_mutex_lock(&r->hub->lock);
        kx_peer_kill_locked(r, fa, EPIPE);    /* c closed: posts to it fail so already */
        pthread_mutex_unlock(&r->hub->lock);
        if (__atomic_load_n(&p->busy, __ATOMIC_SEQ_CST) > 0)
            goto leave;    /* a post bracket still open (it will fail): next pass */
        if (slot < 0)
            slot = kx_forget_slot(self, c->name, c->len);
        if (fi_av_remove(r->av, &fa, 1, 0) != 0)
            goto leave;
        kx_local *cell = kx_peer_forget_entry(r, fa);   /* its holds go below, all at once */
        if (cell)
            kx_local_unref(cell);
        tracked++;
    }
    if (!tracked) {
        /* mapped by its connection request only (or not at all): shm's insert finds the map
         * entry by name (or makes one from the still open region), the remove drops it */
        fi_addr_t fa = FI_ADDR_NOTAVAIL;
        if (fi_av_insert(r->av, c->name, 1, &fa, 0, NULL) == 1 && fa != FI_ADDR_NOTAVAIL) {
            slot = kx_forget_slot(self, c->name, c->len);
            if (fi_av_remove(r->av, &fa, 1, 0) != 0)
                goto leave;
        }
    }
    if (slot >= 0)
        kx_forget_slot_reset(self, slot);
    done = 1;
leave:
    pthread_mutex_unlock(&r->av_lock);
    if (done)
        kx_local_unlink_all(r, c);    /* may close c's fids (the last hold); still entered, so
                                       * our own teardown waits for it */
    kx_leave(r);
    return done;
unlock:
    pthread_mutex_unlock(&r->av_lock);
    return 0;
}

/* From a turn on the CQ (kx_progress_once, poll_owner held): forget the closed engines due. */
int kx_forget_step(kx_rail *r)
{
    kx_local *self = r->self_local;
    if (!self || !self->peer_data || !__atomic_load_n(&self->forgets, __ATOMIC_ACQUIRE))
        return 0;
    kx_local *due[KX_FORGET_BATCH];
    int n = kx_local_forget_due(r, due, KX_FORGET_BATCH), done = 0;
    for (int i = 0; i < n; i++) {
        if (kx_forget_one(r, due[i]))
            done++;
        else
            kx_local_forget_later(r, due[i]);
        kx_local_unref(due[i]);
    }
    return done;
}
